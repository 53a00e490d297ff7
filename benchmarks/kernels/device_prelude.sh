# The start the kernel device scripts share (device_v3.sh, device_v4.sh, device_ws.sh source it from the
# repository root once PY and DRY_RUN are set):
#  * FOURSIGHT_COMMIT, else git's HEAD, else "unknown" (a device copy has no git: pass it);
#  * the package: on the device the one staging step, `source benchmarks/device/stage.sh --need base` (the
#    carried part of `.venv/bin/python benchmarks/device/prepare.py --profile base`: FourSight installed from this
#    tree with pydantic and its other dependencies); a failed step exits with its code (3: the machine went back,
#    4: a later part is still to come). The CPU dry run (DRY_RUN=1) stages nothing: the interpreter's installed
#    package, or DRY_PYTHONPATH;
#  * KSHA: the sha256 of kernels/*.py (name, then bytes; benchmarks/common.py's kernels_sha256).
if [ -z "${FOURSIGHT_COMMIT:-}" ]; then
  FOURSIGHT_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
fi
export FOURSIGHT_COMMIT
if [ "$DRY_RUN" = "1" ]; then
  if [ -n "${DRY_PYTHONPATH:-}" ]; then export PYTHONPATH=$DRY_PYTHONPATH; fi
else
  source benchmarks/device/stage.sh --need base || exit $?
fi
KSHA=$($PY -c "
import hashlib, pathlib
h = hashlib.sha256()
for f in sorted(pathlib.Path('kernels').glob('*.py')):
    h.update(f.name.encode()); h.update(f.read_bytes())
print(h.hexdigest())")
