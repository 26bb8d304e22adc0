"""Tensor parallelism: an engine's model split over its worker ranks (issue 19).

- group.py: TensorParallel, the ranks' torch.distributed group and its collectives (identity
  with one rank);
- rendezvous.py: how the ranks of an engine meet (`init_group`);
- shard.py: which slice of each checkpoint tensor a rank holds (`Split`, `cut`), and one rank's
  ModelConfig for the attention backend;
- sampling.py: rank 0 samples, the others take its ids.
The layers that use them are the models package's parallel layers; the model runner wires them
up.
"""
