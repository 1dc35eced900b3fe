"""The HF engines under the transformers this SGLang version pins (0.5.17: transformers 5.12.1, in
``.deps/sglang-0.5.17``): what runs in one environment with SGLang on the GPU machine.

The static KV cache (``engines/static_cache.py``) implements transformers' abstract
``CacheLayerMixin``, whose abstract methods changed between 5.12 and 5.24; a missing one made the
HF static batch generator fail next to SGLang 0.5.17. Here it runs for real against transformers'
own ``generate`` under whichever transformers the suite imports.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers import LlamaForCausalLM
from transformers.cache_utils import CacheLayerMixin

from eagle3_ray.engines.static_cache import SlotLayer
from eagle3_ray.engines.static_generate import StaticBatchGenerator


def test_slot_layer_implements_every_abstract_method_of_the_installed_transformers():
    abstract = {n for n, v in inspect.getmembers(CacheLayerMixin) if getattr(v, "__isabstractmethod__", False)}
    assert abstract, f"transformers {transformers.__version__}: CacheLayerMixin has no abstract methods left"
    assert not (SlotLayer.__abstractmethods__), (transformers.__version__, sorted(SlotLayer.__abstractmethods__))


def test_static_generator_equals_transformers_generate(tiny_llama_config):
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, tiny_llama_config.vocab_size, (n,), generator=g).tolist() for n in (3, 11, 6)]
    want = []
    for p in prompts:  # one at a time: no padding at all; EOS id 2 never sampled from ids >= 3 is fine
        out = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=2)
        gen = out[0, len(p):].tolist()
        want.append(gen[: next((i + 1 for i, t in enumerate(gen) if t == 2), len(gen))])
    assert StaticBatchGenerator(model, [2], pad_id=2).generate(prompts, 12) == want
