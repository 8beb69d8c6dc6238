"""Checkpoints: the files and their meta.json (`files`, torch-free), saving a run (`save`),
loading it under any layout (`load`), the tensors' sharding for torch.distributed.checkpoint
(`dcp`), and checkpoints rewritten for another layout or dtype (`convert`).

Nothing is imported here, so `megatrain.checkpoint.files` stays importable without torch.
"""
