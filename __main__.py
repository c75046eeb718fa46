"""``python -m npattn`` run from the folder that holds this clone (named npattn).

Python then takes this folder, which has no ``__init__.py``, for a namespace package named
npattn, and runs this file instead of the package's ``__main__``. It hands over to the
package inside (this clone's ``npattn/``), as if run from the clone itself. Not installed:
``setup.cfg`` packages ``npattn/`` only.
"""
import os
import runpy
import sys

_CLONE = os.path.dirname(os.path.abspath(__file__))
for _name in [name for name in sys.modules if name == "npattn" or name.startswith("npattn.")]:
    del sys.modules[_name]  # the namespace package, and anything imported under it
sys.path.insert(0, _CLONE)
runpy.run_module("npattn", run_name="__main__", alter_sys=True)
