"""``souffle-tvm fit``: refit the latency model on one device's timing cache; later compiles on
that device price with the refitted constants."""

from __future__ import annotations

from pathlib import Path

from ..errors import SouffleError
from .options import EXIT_OK


def add_parser(sub) -> None:
    p = sub.add_parser("fit", help="refit the latency model on a device's timing cache (filled by compile --measure)",
                       description="Refit the latency model's constants on what `compile --measure` timed on one "
                                   "GPU (its timing cache in $SOUFFLE_TVM_CACHE/timing): the error before and "
                                   "after is printed, and later compiles on that device use the new constants.")
    p.add_argument("--cache", default=None, metavar="FILE",
                   help="the device's timing cache (default: the local GPU's, or the only GPU cache there is)")
    p.set_defaults(handler=cmd_fit)


def _default_cache():
    from ..core.files import cache_root
    from ..cost.timing_cache import SUBDIR, TimingCache
    from ..measure.device import local_gpu_info

    gpus = [c for c in TimingCache.all() if c.device.get("kind") == "cuda"]
    here = local_gpu_info()
    mine = [c for c in gpus if here is not None and c.device == here]
    if mine or len(gpus) == 1:
        return (mine or gpus)[0]
    where = cache_root() / SUBDIR
    if not gpus:
        raise SouffleError(f"no GPU timing cache in {where}: run `souffle-tvm compile --fusion souffle --measure` on "
                           "a GPU (or through --rpc-tracker) first")
    raise SouffleError(f"{len(gpus)} GPU timing caches in {where}: name one with --cache "
                       f"({', '.join(c.path.name for c in gpus)})")


def cmd_fit(args) -> int:
    from ..cost import device_fit
    from ..cost.timing_cache import TimingCache

    if args.cache:
        try:
            cache = TimingCache.load(Path(args.cache))
        except ValueError as err:
            raise SouffleError(f"--cache: {err}") from None
    else:
        cache = _default_cache()
    r = device_fit.refit(cache)
    print(f"refitted on {cache.device.get('name')} ({r.gpu} table): {r.totals} measured totals, {r.kernels} kernels")
    print(f"median |predicted / measured - 1|: {r.before:.1%} before, {r.after:.1%} after")
    print("constants: " + ", ".join(f"{k} {v:.4g}" for k, v in r.constants.as_dict().items()))
    print(f"written to {cache.path}: later compiles on this device price with them")
    return EXIT_OK
