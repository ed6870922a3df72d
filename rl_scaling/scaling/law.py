"""The sigmoid compute law of ScaleRL and its power-law tail.

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)
         = R0 + (A - R0) * expit(B * (ln C - ln C_mid))

A is the asymptotic pass rate, B > 0 the steepness, C_mid the compute at which half of the gain
A - R0 is reached, R0 the pass rate at C = 0. For C >> C_mid the law becomes the power law
R ~ A - D / C^B with D = (A - R0) * C_mid^B.

Every function broadcasts over its arguments (numpy rules), so a (R, 1) column of parameters against
an (N,) row of compute values gives an (R, N) table: one curve per replicate.

The fitting code works in the parameter vector theta = (A, B, u = ln C_mid, R0): C_mid spans orders
of magnitude and its log makes the least-squares problem much better conditioned.
"""

from __future__ import annotations

import numpy as np
from scipy.special import expit

PARAMS = ("A", "B", "C_mid", "R0")
# ln(0) stands in for C = 0 as a very negative finite number so that s(0) = 0 and the Jacobian stays finite.
_LOG_ZERO = -700.0


def _log_c(c):
    c = np.asarray(c, dtype=float)
    with np.errstate(divide="ignore"):
        return np.where(c > 0, np.log(np.where(c > 0, c, 1.0)), _LOG_ZERO)


def sigmoid(c, A, B, C_mid, R0):
    """Pass rate at compute c (c >= 0; R(0) = R0)."""
    return R0 + (A - R0) * expit(B * (_log_c(c) - np.log(C_mid)))


def inverse(r, A, B, C_mid, R0):
    """Compute needed to reach pass rate r: C = C_mid * ((A - R0) / (r - R0) - 1)^(-1/B).

    Returns 0 at r == R0, inf for targets at or beyond the asymptote A, nan for targets on the far side of R0.
    """
    r, A, B, C_mid, R0 = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (r, A, B, C_mid, R0)))
    frac = (r - R0) / (A - R0)  # share of the gain, must lie in [0, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = C_mid * (1.0 / frac - 1.0) ** (-1.0 / B)
    c = np.where(frac >= 1.0, np.inf, c)
    c = np.where(frac == 0.0, 0.0, c)
    return np.where(frac < 0.0, np.nan, c)


def tail_coefficient(A, B, C_mid, R0):
    """D of the power-law tail R ~ A - D / C^B that the sigmoid approaches for C >> C_mid."""
    return (np.asarray(A) - R0) * np.asarray(C_mid, dtype=float) ** B


def power_law(c, A, D, B):
    """The power law R = A - D / C^B (the paper's rival form)."""
    c = np.asarray(c, dtype=float)
    with np.errstate(divide="ignore"):
        return A - D * np.exp(-B * _log_c(c))


def gain_fraction(c, B, C_mid):
    """Share of the gain A - R0 reached at compute c: 1 / (1 + (C_mid / c)^B)."""
    return expit(B * (_log_c(c) - np.log(C_mid)))


# ---- the forms the solvers use: theta (..., P) against log-compute z (..., N) ----

def sigmoid_theta(z, theta):
    """Model values and Jacobian d f / d(A, B, u, R0); theta (R, 4), z (N,) or (R, N) -> (R, N), (R, N, 4)."""
    A, B, u, R0 = (theta[:, i : i + 1] for i in range(4))
    s = expit(B * (z - u))
    ds = s * (1.0 - s)
    f = R0 + (A - R0) * s
    jac = np.stack(
        np.broadcast_arrays(s, (A - R0) * ds * (z - u), -(A - R0) * ds * B, 1.0 - s), axis=-1
    )
    return f, jac


def power_theta(z, theta):
    """Power law in theta = (A, B, v = ln D): f = A - exp(v - B z); values and Jacobian."""
    A, B, v = (theta[:, i : i + 1] for i in range(3))
    t = np.exp(np.minimum(v - B * z, 50.0))  # the cap only bites for absurd trial steps
    f = A - t
    jac = np.stack(np.broadcast_arrays(np.ones_like(t), t * z, -t), axis=-1)
    return f, jac


def theta_to_params(theta):
    """(A, B, u, R0) -> dict with C_mid = exp(u)."""
    theta = np.asarray(theta, dtype=float)
    return {"A": theta[..., 0], "B": theta[..., 1], "C_mid": np.exp(theta[..., 2]), "R0": theta[..., 3]}
