"""Sigmoid compute law: fits, uncertainty, comparison, loaders and plots."""
