# The one staging step of every device script: `source benchmarks/device/stage.sh [--need PROFILE] [--receive-only]`
# from the repository root on the device. It runs stage.py (receive the carried .devcarry/p* parts, assemble what
# is complete, install FourSight from the tree) and exports PYTHONPATH, FOURSIGHT_STAGE and FOURSIGHT_PARTS_COMMIT.
# A failure returns stage.py's code: 3 = the machine went back (start the sequence again from call 1),
# 4 = a later part is still to come (carry it in the next call), 2 = anything else (the message says what).
_fs_env=$("${PY:-python3}" "$(dirname "${BASH_SOURCE[0]}")/stage.py" "$@")
_fs_rc=$?
if [ "$_fs_rc" -eq 0 ]; then eval "$_fs_env"; fi
unset _fs_env
return "$_fs_rc" 2>/dev/null || exit "$_fs_rc"
