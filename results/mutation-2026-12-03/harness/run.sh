#!/bin/bash
# Mutation pass over one module (results/mutation-2026-12-03/README.md; since 2026-12-08 `dep` also
# selects tests/test_resident.py and `groups` has tests/test_groups.py: results/mutation-2026-12-08/):
#   bash results/mutation-2026-12-03/harness/run.sh dep|races|groups [--after]
# Copies the working tree (without .venv/.git) to /tmp/mut-NAME, never mutating this checkout;
# starts a fork server that imports TVM once (harness/forkserver.py); runs mutmut 2.5.1 (the
# `dev` extra) with a runner that asks the server for one pytest run per mutant. --after runs
# the mutants-only test file first (mutmut re-tests only the survivors of the previous run when
# the tests changed: its cache is /tmp/mut-NAME/.mutmut-cache).
set -euo pipefail
name=$1; after=${2:-}
main=$(cd "$(dirname "$0")/../../.." && pwd)
here=$(cd "$(dirname "$0")" && pwd)
py=$main/.venv/bin/python
copy=${MUT_COPY:-/tmp/mut-$name}
case $name in
  dep)
    module=souffle_tvm/stitch/dependence.py
    extra=tests/test_dependence_mutants.py
    tests="tests/test_resident.py tests/test_two_phase.py tests/test_onchip.py tests/test_stitch.py"
    k="test_resident or partials_run or next_blocks or removed_block_barrier_is_caught or atomic_kernel_zero_fills or reader_of_atomic or zero_fill_are or block_local_intermediate or read_after_the_kernel or fused_loop_without or read_before_it_is_written or never_leaves_the_chip or without_the_channel or static_check"
    ;;
  races)
    module=souffle_tvm/runtime/races.py
    extra=tests/test_races_mutants.py
    tests="tests/test_races.py"
    k="small_kernels or same_value or order_asked or named_or_seeded or needs_its_inputs or does_not_import or (removed_block_barrier and softmax and not on_chip)"
    ;;
  groups)
    module=souffle_tvm/partition/groups.py
    extra=tests/test_groups.py
    tests="tests/test_two_phase.py tests/test_onchip.py tests/test_stitch.py tests/test_report_html.py"
    k="partials_run or next_blocks or partitioner_credits or subprogram_cuts or group_edges"
    ;;
  *) echo "dep, races or groups" >&2; exit 2;;
esac
mkdir -p $copy
if [ ! -f $copy/.mutmut-cache ]; then
  (cd $main && tar --exclude=./.venv --exclude=./.git --exclude='./*.egg-info' --exclude='__pycache__' -cf - .) | tar -xf - -C $copy
fi
if [ "$after" = --after ]; then
  cp $main/$extra $copy/$extra
  tests="$extra $tests"
  k="$(basename $extra .py) or $k"
else
  rm -f $copy/tests/test_*_mutants.py
fi
# the third-party modules the tests import, for the server to import once
PYTHONPATH=$copy $py - <<PY
import sys, json
sys.path.insert(0, "$copy/tests")
import pytest
import souffle_tvm.pipeline.results, souffle_tvm.runtime.races, souffle_tvm.frontend.importer, souffle_tvm.stitch.kernel
mods = sorted(m for m in sys.modules if m.split(".")[0] not in ("souffle_tvm", "conftest", "__main__") and not m.startswith("test_"))
json.dump(mods, open("$copy/.premods.json", "w"))
PY
sock=$copy/.forkserver.sock
rm -f $sock
PYTHONPATH=$copy PYTHONDONTWRITEBYTECODE=1 nice -n 10 $py $here/forkserver.py $sock $copy/.premods.json $copy > $copy/.forkserver.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
until grep -q ready $copy/.forkserver.log 2>/dev/null; do sleep 1; done
cat > $copy/.runner.sh <<RUN
#!/bin/bash
exec $py -S -E $here/client.py $sock $copy/.last-run.log -x -q -p no:xdist -p no:cacheprovider $tests -k "$k"
RUN
chmod +x $copy/.runner.sh
cd $copy
start=$(date +%s)
PYTHONDONTWRITEBYTECODE=1 $main/.venv/bin/mutmut run --paths-to-mutate $module --runner $copy/.runner.sh \
  --tests-dir tests/ --simple-output > $copy/.mutmut.log 2>&1 || true
echo "mutmut run: $(( $(date +%s) - start )) s"
$main/.venv/bin/mutmut results || true
