"""``import npattn`` needs only NumPy: Numba, SciPy and CuPy load when a backend asks for them."""
import subprocess
import sys


def test_import_loads_no_optional_dependency():
    code = ("import sys, npattn; npattn.attention; npattn.backends(); "
            "print(sorted(m for m in ('numba', 'scipy', 'cupy', 'torch', 'jax') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"


def test_autograd_and_optim_need_only_numpy():
    code = ("import sys, npattn.autograd, npattn.optim; "
            "print(sorted(m for m in ('numba', 'scipy', 'cupy', 'torch', 'jax') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
