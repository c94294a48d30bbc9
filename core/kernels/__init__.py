"""Numerical kernels shared by the models and the losses."""
