"""Triton kernels and their launchers (no autograd, no input checks beyond what a launch needs).

Installed as the private package ``pykernels._kernels``; only ``pykernels`` calls it.
"""
