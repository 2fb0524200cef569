#!/usr/bin/env bash
# The GPU bench on a machine that has a CUDA build of torch and nothing of ours, from what
# `python bench/gpu.py --prepare DIR` left in DIR (the renders and the wheels they need beyond torch):
#
#   bash bench/gpu_machine.sh DIR [bench/gpu.py options, e.g. --rows all]
#
# It installs the wheels into a folder of their own, named in a .pth file of the interpreter's
# site-packages so that every process it starts finds them, whatever PYTHONPATH that process is
# given (the image's own packages keep precedence), then runs bench/gpu.py on the renders. The
# JSON file goes to $OUT/gpu.json where OUT is set, else DIR/gpu.json, rewritten as each row ends.
set -euo pipefail

dir=${1:?usage: bash bench/gpu_machine.sh DIR [bench/gpu.py options]}
shift
here=$(cd "$(dirname "$0")" && pwd)
# The first Python that has torch: $PYTHON, python3, or the GPU image's venv.
python=
for candidate in "${PYTHON:-}" python3 /opt/torch/.venv/bin/python3; do
    if [[ -n "$candidate" ]] && "$candidate" -c 'import torch' 2>/dev/null; then
        python=$candidate
        break
    fi
done
[[ -n "$python" ]] || { echo "bench/gpu_machine.sh: no Python with torch (set PYTHON)" >&2; exit 1; }
site=${BENCH_SITE:-/tmp/bench-site}
"$python" -m pip install -q --upgrade --no-index --no-deps --target "$site" "$dir"/wheels/*.whl
if ! echo "$site" > "$("$python" -c 'import site; print(site.getsitepackages()[0])')/zz_bench_site.pth"; then
    echo "bench/gpu_machine.sh: site-packages is read-only; PYTHONPATH=$site instead (launches keep it)" >&2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -c 'import torch, tyro, torchao; print(f"torch {torch.__version__}, tyro {tyro.__version__}, torchao {torchao.__version__}")'
exec "$python" "$here/gpu.py" --renders "$dir" --json "${OUT:-$dir}/gpu.json" "$@"
