"""Where S6's wall time goes: encoder and decoder node time per batch, and a torch profile."""
import sys, time, tempfile, collections
from pathlib import Path
sys.path.insert(0, '.')
import torch
import benchmarks.s6_parakeet as s6
import mstar.model.fastconformer.engine as eng

times = collections.defaultdict(list)
orig_run = eng.TransducerDecoder.run
def run(self, items):
    t = time.perf_counter(); out = orig_run(self, items); times[f"decode@{len(items)}"].append(time.perf_counter() - t); return out
eng.TransducerDecoder.run = run
orig_enc = eng.encoder_fn
def encoder_fn(model, lookahead):
    f = orig_enc(model, lookahead)
    def g(op, items):
        t = time.perf_counter(); out = f(op, items); torch.cuda.synchronize(); times[f"encode@{len(items)}"].append(time.perf_counter() - t); return out
    return g
eng.encoder_fn = encoder_fn

args = s6.parse_args(sys.argv[1:])
settings = s6.settings_from(args)
tmp = Path(tempfile.mkdtemp())
model = s6.parakeet_dir(tmp, settings); del model
clips = s6.clip_set(settings, 32, 0)
runner = s6.OursRunner(settings, tmp)
for n in (1, 32):
    r = runner.requests(clips[:n]); runner.run(r); runner.run(r)
    times.clear()
    wall, _ = runner.run(r)
    print(f"== {n} clips: wall {wall*1e3:.1f} ms; " + "; ".join(f"{k}: {len(v)} calls {sum(v)*1e3:.1f} ms ({', '.join(f'{x*1e3:.1f}' for x in v)})" for k, v in times.items()))
from torch.profiler import profile, ProfilerActivity
for n in ():
    r = runner.requests(clips[:n])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = runner.run(r)
    ka = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in ka) / 1e3
    print(f"profiled {n}: wall {wall*1e3:.1f} ms, GPU kernel time {gpu:.1f} ms")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=50))
    print(ka.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=50))
runner.close()
