"""The law, its inverse and its power-law tail."""

import numpy as np
import pytest

from rl_scaling.scaling import law


def test_sigmoid_values_and_broadcast():
    c = np.array([0.0, 50.0, 100.0, 200.0, 1e9])
    r = law.sigmoid(c, 0.6, 2.0, 100.0, 0.2)
    assert r[0] == pytest.approx(0.2)  # R(0) = R0
    assert r[2] == pytest.approx(0.4)  # half the gain at C_mid
    assert r[-1] == pytest.approx(0.6, abs=1e-9)  # the ceiling
    assert np.all(np.diff(r) > 0)
    table = law.sigmoid(c[None, :], np.array([[0.6], [0.7]]), 2.0, 100.0, 0.2)
    assert table.shape == (2, 5)


def test_logistic_form_matches():
    c = np.geomspace(1, 1e4, 50)
    direct = 0.1 + (0.7 - 0.1) / (1 + (300.0 / c) ** 1.5)
    np.testing.assert_allclose(law.sigmoid(c, 0.7, 1.5, 300.0, 0.1), direct, rtol=1e-12)


def test_inverse_roundtrip_and_edges():
    c = np.geomspace(1, 1e5, 30)
    r = law.sigmoid(c, 0.65, 1.8, 2500.0, 0.3)
    np.testing.assert_allclose(law.inverse(r, 0.65, 1.8, 2500.0, 0.3), c, rtol=1e-8)
    assert law.inverse(0.3, 0.65, 1.8, 2500.0, 0.3) == 0.0
    assert np.isinf(law.inverse(0.65, 0.65, 1.8, 2500.0, 0.3))
    assert np.isinf(law.inverse(0.70, 0.65, 1.8, 2500.0, 0.3))
    assert np.isnan(law.inverse(0.20, 0.65, 1.8, 2500.0, 0.3))


def test_power_law_tail():
    A, B, cm, r0 = 0.61, 1.92, 2542.0, 0.3
    D = law.tail_coefficient(A, B, cm, r0)
    c = np.array([1e6, 1e7])
    np.testing.assert_allclose(law.power_law(c, A, D, B), law.sigmoid(c, A, B, cm, r0), rtol=1e-6)


def test_jacobian_matches_finite_differences():
    z = np.log(np.geomspace(10, 1e4, 25))
    theta = np.array([[0.6, 1.7, np.log(800.0), 0.25]])
    _, jac = law.sigmoid_theta(z, theta)
    for i in range(4):
        d = np.zeros_like(theta)
        d[0, i] = 1e-6
        fd = (law.sigmoid_theta(z, theta + d)[0] - law.sigmoid_theta(z, theta - d)[0]) / 2e-6
        np.testing.assert_allclose(jac[0, :, i], fd[0], atol=1e-7)
    ptheta = np.array([[0.8, 0.5, np.log(2.0)]])
    _, pj = law.power_theta(z, ptheta)
    for i in range(3):
        d = np.zeros_like(ptheta)
        d[0, i] = 1e-6
        fd = (law.power_theta(z, ptheta + d)[0] - law.power_theta(z, ptheta - d)[0]) / 2e-6
        np.testing.assert_allclose(pj[0, :, i], fd[0], atol=1e-7)
