"""The paged KV path, read top to bottom:

- pool.py: which layers own KV, how many pages fit, the KV tensors (and an fp8 pool's scales);
- tables.py (+ page_lists.py): each kind's page tables and the step's page metadata, in numpy;
- staging.py: the step's small arrays to the device in one async copy;
- step.py: StepContext, one model's paged state and the step being run (picks the backends);
- cache.py: PagedCache, the transformers Cache generate carries;
- attention_function.py: what HF's attention layers call (kv_append, then the step's backend);
- forward.py: one forward call on a PagedCache (the step begun, graphs replayed);
- install.py: all of it on a model (its generate brings a PagedCache);
- backends/: the reference, FlashInfer and Triton backends behind one interface (base.py).
"""
