"""BMTrain's surface (`import fbmt as bmt`), lowered onto `fbmt.compile`: one implementation of ZeRO.

- `parameter`: DistributedParameter, ParameterInitializer; whole tensors of partial parameters
- `module`: DistributedModule, lowering (NOTE: [Lowering]), init_parameters
- `block`: Block / CheckpointBlock, TransformerBlockList, BMTrainModelWrapper
- `store`: save / load of full state dicts
- `inspect`, `lr_scheduler`, `loss`, `nn`, `utils`, `global_var`: BMTrain's modules of those names,
  also importable as `fbmt.<name>`

It uses the compiler only through `fbmt.api`, `fbmt.layout` and `fbmt.trace` (and `fbmt.ops.record`).
`OptimManager` lives with the optimizers (`fbmt.optim`), whose Adams serve both ways in.
"""
