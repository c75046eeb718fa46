"""Fit the polynomial behind :mod:`npattn.cpu.activations`' normal CDF (for developers).

    python -m npattn.tools.fit_normal_cdf [DEGREE]

For z >= 0, erfc(z) = exp(-z^2) erfcx(z), where erfcx (the scaled complementary error
function) falls smoothly from 1 at z = 0 to about 1 / (z sqrt(pi)). With t = 2 / (2 + z)
in (0, 1], erfcx(z) / t is a smooth function of t, fitted here on [T_LOW, 1] (z up to
Z_HIGH, past which float32's normal CDF is 0 or 1) by a Chebyshev least-squares fit at
Chebyshev nodes, then written as a polynomial in s = (2 t - 1 - T_LOW) / (1 - T_LOW) in
[-1, 1] (coefficients below 0.6 in size: Horner's rule loses nothing to cancellation).
Prints the coefficients, lowest power first, and the largest relative error against
SciPy's erfcx in float64 over 200001 points. Needs SciPy.
"""
from __future__ import annotations

import sys

import numpy as np

Z_HIGH = 11.0
T_LOW = 2.0 / (2.0 + Z_HIGH)
DEGREE = 14


def fit(degree: int = DEGREE) -> tuple[np.ndarray, float]:
    """``(coefficients in s, lowest power first; largest relative error of t * h(t))``."""
    from numpy.polynomial import chebyshev, polynomial
    from scipy.special import erfcx

    nodes = 4000
    s = np.cos(np.pi * (np.arange(nodes) + 0.5) / nodes)
    t = T_LOW + (1 - T_LOW) * (s + 1) / 2
    z = 2 / t - 2
    coefficients = chebyshev.cheb2poly(chebyshev.chebfit(s, erfcx(z) / t, degree))
    t = np.linspace(T_LOW, 1, 200001)
    z = 2 / t - 2
    approximation = t * polynomial.polyval((2 * t - 1 - T_LOW) / (1 - T_LOW), coefficients)
    return coefficients, float(np.abs(approximation / erfcx(z) - 1).max())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    coefficients, error = fit(int(argv[0]) if argv else DEGREE)
    print(f"# t = 2 / (2 + z), s = (2 t - 1 - T_LOW) / (1 - T_LOW), T_LOW = 2 / (2 + {Z_HIGH:g}); "
          f"largest relative error {error:.2e}")
    print("(" + ", ".join(repr(float(c)) for c in coefficients) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
