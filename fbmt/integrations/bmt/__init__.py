"""BMTrain's surface (`import fbmt as bmt`), lowered onto `fbmt.compile`: one implementation of ZeRO.

- `parameter`: DistributedParameter, ParameterInitializer; whole tensors of partial parameters
- `module`: DistributedModule, lowering (NOTE: [Lowering]), init_parameters
- `block`: Block / CheckpointBlock, TransformerBlockList, BMTrainModelWrapper
- `store`: save / load of full state dicts
- `distributed`: init_distributed with BMTrain's signature, `config`, the differentiable collectives
- `inspect`, `lr_scheduler`, `loss`, `nn`, `utils`, `global_var`, `distributed`: BMTrain's modules of
  those names, also importable as `fbmt.<name>`

It uses the compiler only through its public names (`fbmt.compiler`, and `ops.record` for
`inspect.record_tensor`), as every integration does (tests/test_layers.py). `OptimManager` lives with
the optimizers (`fbmt.integrations.optim`, also `fbmt.optim`), whose Adams serve both ways in.
"""
