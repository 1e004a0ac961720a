"""splitgrad.bench — what the split costs and buys, measured (not part of the library: nothing in
``splitgrad.reference``, ``.impl``, ``.distributed`` or ``.properties`` imports it).

* :mod:`.modules` — ``splitgrad bench``: speed and memory ratios of ``splitgrad.impl``'s modules;
* :mod:`.pipeline` — ``splitgrad pipeline``: step time, bubble and memory held between B and W
  under ``torch.distributed.pipelining`` schedules, splitgrad's ``dw_builder`` next to torch's
  own split;
* :mod:`.moe` — ``splitgrad moe``: the share of the expert-parallel dispatch all-to-all hidden
  behind ``backward_dw()``;
* :mod:`.tensor_parallel` — what a queued entry holds per rank under tensor parallelism at real
  scale (fake tensors, torch's fake process group), the collectives of each phase, and the step
  time of the two ``wgrad_gather`` modes;
* :mod:`.actions` — recording a schedule's F/B/I/W actions on one rank (also used by
  ``examples/llama_pipeline.py``); :mod:`.ranks` — spawned ranks or torchrun;
  :mod:`.options` — the commands' argument types.
"""
