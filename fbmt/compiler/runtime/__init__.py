"""The runtime: executes a program on torch.distributed.

- `partition`: a Program -> a forward and a backward GraphModule (an Executable), with the IR's
  collectives lowered to their kinds' implementations (the table of `fbmt.compiler.collectives`)
- `autograd`: an Executable run as one autograd.Function
- `regions`: backend="inductor": the compute between collectives compiled by Inductor
- `graphs`: cuda_graph=True: a training step's forward and backward replayed as CUDA graphs
- `params`: the flat shards, built from a module (block by block from the meta device) and gathered;
  the placeholders' requires_grad kept in step with them; buffer broadcast
- `reference`: the reference executor, the definition of what a program means

It imports the IR (`program`, `layout`, `meta`, `ops`, `collectives`), never the passes.
"""
