"""In process, the demo pair: 8 rows streaming at block 8 (drafting), a 1,100-token prompt joining at step 20;
per step seconds and chunk tokens; the worst chunk step over the median plain step."""

import json
import statistics
import sys

import torch

from dflash_trt.bench.prompts import held_out_code_prompts
from dflash_trt.decoding import BatchDecoder, GenerationConfig
from dflash_trt.loading import load_decoder
from dflash_trt.settings import DEMO_DRAFTER, DEMO_TARGET

torch.set_num_threads(1)
d = load_decoder(DEMO_TARGET, DEMO_DRAFTER)
dec = BatchDecoder(d.target, d.drafter, d.tokenizer, block_size=8)
tok = d.tokenizer
prompts = [tok.encode(t) for t in held_out_code_prompts(8)]
long_ids = []
for t in held_out_code_prompts(20, prefix_chars=3000)[8:]:
    long_ids += tok.encode(t)
long_ids = long_ids[:1100]
rows = [dec.add(p, GenerationConfig(max_new_tokens=1000)) for p in prompts]
log = []
long = None
for i in range(2000):
    if i == 20:
        long = dec.add(long_ids, GenerationConfig(max_new_tokens=4))
    p = dec.step().profile
    log.append((p.total_s, p.chunk_tokens, p.prefill_tokens))
    if long is not None and long.done:
        break
plain = [s for s, c, pf in log[5:] if c == 0 and pf == 0]
chunk = [(s, c) for s, c, pf in log if c]
med = statistics.median(plain)
print(
    json.dumps(
        {
            "tree": sys.argv[1],
            "median_plain_ms": round(1e3 * med, 1),
            "worst_chunk_step_ratio": round(max(s for s, _ in chunk) / med, 2),
            "chunk_steps": len(chunk),
            "chunk_sizes": [c for _, c in chunk],
            "chunk_step_ratios": [round(s / med, 2) for s, _ in chunk],
        }
    )
)
