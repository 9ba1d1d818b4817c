"""The runtime: executes a program on torch.distributed.

- `partition`: a Program -> a forward and a backward GraphModule (an Executable), with the IR's
  collectives lowered to their implementations in `collectives` (which uses `copies`)
- `autograd`: an Executable run as one autograd.Function
- `regions`: backend="inductor": the compute between collectives compiled by Inductor
- `graphs`: cuda_graph=True: a training step's forward and backward replayed as CUDA graphs
- `params`: the flat shards, built from a module (block by block from the meta device) and gathered

It imports the IR (`fbmt.program`, `fbmt.layout`, `fbmt.ops`), never the passes.
"""
