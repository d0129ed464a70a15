"""One full-size LSTM layer (100 steps, hidden 256): launches, analytic and counted bytes (GPU emulator), predicted graph time and floors, for TVM, the rolled v3 kernel and the default. Usage: python python/lstm_layer_counted.py OUT.json"""
import sys, time, json
from souffle_tvm.pipeline import driver
from souffle_tvm.zoo import lstm as lstm_zoo
m = lstm_zoo.build(lstm_zoo.LSTMConfig(layers=1, steps=100, hidden=256, features=256, batch=1))
out = {}
for label, kw in (("tvm", dict(fusion="tvm")), ("v3 (rolled)", dict(fusion="souffle", level="v3")),
                  ("default", dict(fusion="souffle", level="auto"))):
    t = time.time()
    c = driver.compile(m, "cuda", count_traffic=True, **kw)
    r = c.report
    kr = r.kernels
    out[label] = {"launches": r.launches, "analytic_MB": r.bytes / 1e6,
                  "counted_MB": (r.counted or {}).get("bytes", 0) / 1e6,
                  "sector_MB": (r.counted or {}).get("sector_bytes", 0) / 1e6,
                  "graph_ms": r.latency.get("graph_ms"),
                  "pred_us": sum(k.launches * (k.predicted_us or 0) for k in kr),
                  "floor_us": sum(k.launches * (k.floor_us or 0) for k in kr),
                  "below_floor": sum(1 for k in kr if (k.predicted_us or 0) < (k.floor_us or 0) - 1e-9),
                  "untimed": sum(1 for k in kr if k.measured_form is False), "kernels": len(kr),
                  "fallback": r.fallback, "s": round(time.time() - t, 1)}
    print(label, out[label], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
