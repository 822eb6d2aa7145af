# Sourced by `bash scripts/test.sh --stack device` (from the repository root): build, once, and
# activate a second venv with the GPU machine's stack (scripts/gpu/device-stack.txt: torch
# 2.11.0, transformers 5.17.0, accelerate 1.15.0, triton 3.6.0; the package's own requirements
# from setup.cfg beside them), then install this clone's package into it.
#
# The venv lives outside the clone, in $HF_ZOFFLOAD_CACHE (default ~/.cache/hf_zoffload), in a
# folder named by a hash of what it is built from: the pins, the requirements, the build
# requirements and the interpreter. A change to any of them builds a new one and removes the
# old (each is ~5 GB: torch 2.11.0 is on the registry only as its CUDA build). A build cut short
# has no `.complete` file and is built again. Interpreter: CPython 3.12, the GPU machine's,
# where one is found ($PYTHON_DEVICE overrides), else python3 (said so).
# The package goes in editable (--no-deps, no build isolation), so the tests run this clone's
# code; it is reinstalled when the clone or its build files change (the stamp below), which
# compiles the kernel for this interpreter beside the main .venv's (another file name).
_STACK_FORMAT=1  # bump when the steps below change what a built venv holds
_STACK_PINS=scripts/gpu/device-stack.txt

_stack_python() {
    if [ -n "${PYTHON_DEVICE:-}" ]; then
        echo "$PYTHON_DEVICE"
        return
    fi
    local c candidates=(python3.12)
    if command -v pyenv >/dev/null 2>&1; then
        candidates+=("$(pyenv root)"/versions/3.12*/bin/python3.12)
    fi
    for c in "${candidates[@]}"; do
        if "$c" -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
            echo "$c"
            return
        fi
    done
    echo python3
}

# The requirement lines the venv is built from: the pins, setup.cfg's install_requires and
# test extras, pyproject's build requirements (the package is built without isolation).
_stack_requirements() {
    "$_STACK_PY" - "$_STACK_PINS" <<'PY'
import configparser, sys, tomllib
lines = [l.split("#", 1)[0].strip() for l in open(sys.argv[1])]
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
for value in (cfg["options"]["install_requires"], cfg["options.extras_require"]["test"]):
    lines += value.splitlines()
lines += tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]
print("\n".join(l.strip() for l in lines if l.strip()))
PY
}

_STACK_PY="$(_stack_python)"
_STACK_PY_VERSION="$("$_STACK_PY" -c 'import sys; print(sys.version.split()[0])')"
case "$_STACK_PY_VERSION" in
    3.12.*) ;;
    *) echo "[stack] no CPython 3.12 here (the GPU machine's): using $_STACK_PY_VERSION" \
        "($_STACK_PY); set PYTHON_DEVICE to a 3.12 interpreter to match it" >&2 ;;
esac
_STACK_REQS="$(_stack_requirements)"
_STACK_KEY="$({ echo "format $_STACK_FORMAT"; "$_STACK_PY" -c 'import sys; print(sys.version)'
               echo "$_STACK_REQS"; } | sha256sum | cut -c1-16)"
_STACK_CACHE="${HF_ZOFFLOAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hf_zoffload}"
STACK_VENV="$_STACK_CACHE/device-stack-$_STACK_KEY"

if [ ! -f "$STACK_VENV/.complete" ]; then
    echo "[stack 1/3] building $STACK_VENV (first time for these pins: downloads ~5 GB)"
    rm -rf "$STACK_VENV"
    mkdir -p "$_STACK_CACHE"
    _t0=$(date +%s)
    "$_STACK_PY" -m venv "$STACK_VENV"
    "$STACK_VENV/bin/python" -m pip install -q --upgrade pip
    # one resolve over the pins and the requirements: the pins win or the build fails
    echo "$_STACK_REQS" >"$STACK_VENV/requirements.txt"
    "$STACK_VENV/bin/python" -m pip install -q --progress-bar off \
        -r "$STACK_VENV/requirements.txt"
    _t1=$(date +%s)
    # the older builds (other pins or interpreter) go: ~5 GB each
    for _old in "$_STACK_CACHE"/device-stack-*; do
        if [ "$_old" != "$STACK_VENV" ] && [ -d "$_old" ]; then
            echo "[stack] removing the build for other pins: $_old"
            rm -rf "$_old"
        fi
    done
    echo "built $(date -u +%FT%TZ) in $((_t1 - _t0)) s, $(du -sh "$STACK_VENV" | cut -f1)" \
        >"$STACK_VENV/.complete"
else
    echo "[stack 1/3] using $STACK_VENV ($(cat "$STACK_VENV/.complete"))"
fi
# shellcheck disable=SC1091
source "$STACK_VENV/bin/activate"

_stack_stamp() {
    { pwd; cat setup.py setup.cfg pyproject.toml cython_ext/*; } | sha256sum | cut -d' ' -f1
}
if [ "$(cat "$STACK_VENV/.hf_zoffload_installed" 2>/dev/null)" = "$(_stack_stamp)" ] \
        && python -c 'import hf_zoffload.ops._native as n; n.ext()' 2>/dev/null; then
    echo "[stack 2/3] hf_zoffload from $(pwd) is installed in it: install skipped"
else
    echo "[stack 2/3] installing hf_zoffload from $(pwd) (editable); compiling the kernel for" \
        "Python $_STACK_PY_VERSION"
    rm -f "$STACK_VENV/.hf_zoffload_installed"
    python -m pip install -q --no-deps --no-build-isolation -e .
    _stack_stamp >"$STACK_VENV/.hf_zoffload_installed"
fi
echo "[stack 3/3] $(python -c 'import sys, torch, transformers, accelerate, triton
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, transformers "
      f"{transformers.__version__}, accelerate {accelerate.__version__}, triton "
      f"{triton.__version__}")')"
