"""In a rank's Python: the user's project is imported from its snapshot, not from the working tree.

hpc-ddp's runner runs the snapshot's copy of a script (so the script's folder, sys.path[0], is in the copy)
and sets HPC_DDP_CODE_PROJECT (the project's root in the working tree, resolved) and HPC_DDP_CODE_DIR (its
copy). Other ways Python finds the project still point at the working tree: `python -m` puts the working
directory first on sys.path; PYTHONPATH or a .pth file (an editable install, `pip install -e .`) may name a
folder of the project; setuptools' editable finders map package names to folders of it. `install()` points
each one at the copy: the sys.path entries and the finders' maps there now, and sys.path[0] (which Python
adds only after sitecustomize has run) at the next import, through a finder at the head of sys.meta_path that
rewrites sys.path whenever it changed and finds nothing itself. An entry whose folder the copy does not have
(left out of it) stays as it is.

Imports nothing from hpc-ddp; never lets its own failure reach the user's program.
"""

import os
import sys

PROJECT_VARIABLE = "HPC_DDP_CODE_PROJECT"
DIR_VARIABLE = "HPC_DDP_CODE_DIR"


def pinned_entry(entry, project, copy, cwd):
    """The sys.path entry `entry` pointed into the copy where it names a folder of the project. Pure but
    for resolving links and asking whether the folder is in the copy."""
    if not isinstance(entry, str):
        return entry
    real = os.path.realpath(os.path.join(cwd, entry))
    if real != project and not real.startswith(project.rstrip(os.sep) + os.sep):
        return entry
    real_copy = os.path.realpath(copy)
    if real == real_copy or real.startswith(real_copy.rstrip(os.sep) + os.sep):
        return entry  # in the copy already (a run dir inside the project holds it)
    mapped = copy if real == project else os.path.join(copy, os.path.relpath(real, project))
    return mapped if os.path.exists(mapped) else entry


class _Pinner:
    """A meta-path finder that finds nothing: it re-points sys.path whenever sys.path changed."""

    _hpc_ddp_code = True

    def __init__(self, project, copy):
        self.project, self.copy = project, copy
        self._seen = None

    def pin(self):
        current = tuple(sys.path)
        if current == self._seen:
            return
        try:
            cwd = os.getcwd()
        except OSError:
            return
        new = [pinned_entry(e, self.project, self.copy, cwd) for e in current]
        if new != list(current):
            sys.path[:] = new
        self._seen = tuple(sys.path)

    def find_spec(self, name, path=None, target=None):
        try:
            self.pin()
        except Exception:  # noqa: BLE001 - never the user's program's failure
            pass
        return None

    def invalidate_caches(self):
        self._seen = None


def _pin_editable_finders(project, copy):
    """setuptools' editable installs (`__editable___NAME_finder` modules): MAPPING names a package's folder,
    NAMESPACES a namespace package's folders."""
    try:
        cwd = os.getcwd()
    except OSError:
        return
    for name, module in list(sys.modules.items()):
        if not name.startswith("__editable__") or module is None:
            continue
        mapping = getattr(module, "MAPPING", None)
        if isinstance(mapping, dict):
            for key, value in list(mapping.items()):
                mapping[key] = pinned_entry(value, project, copy, cwd)
        spaces = getattr(module, "NAMESPACES", None)
        if isinstance(spaces, dict):
            for key, values in list(spaces.items()):
                if isinstance(values, list):
                    spaces[key] = [pinned_entry(v, project, copy, cwd) for v in values]


def install(environ=os.environ):
    project, copy = environ.get(PROJECT_VARIABLE), environ.get(DIR_VARIABLE)
    if not project or not copy or any(getattr(f, "_hpc_ddp_code", False) for f in sys.meta_path):
        return
    pinner = _Pinner(project, copy)
    pinner.pin()
    _pin_editable_finders(project, copy)
    sys.meta_path.insert(0, pinner)
