"""The model-level check's runner for MLX folders (the mlx dialect's Engine; model_check/runner.py loads it
in the Python that has mlx-lm and speaks the protocol; never imports qconv). mlx-lm loads the folder as its
users do (``mlx_lm.load``: model and tokenizer); every floating parameter is then cast to float32 (the
quantized weights' scales and biases included), as mlx computes on a CPU, and the logits of the ids are
computed at every position; the tokens are the folder's tokenizer's, on the text without special tokens."""


def run(folder: str, request: dict) -> tuple[dict, object]:
    import importlib.metadata

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_map
    from mlx_lm import load

    model, tokenizer = load(folder)
    model.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x,
                          model.parameters()))
    logits = np.array(model(mx.array([request["ids"]])).astype(mx.float32)[0])
    tokens = tokenizer.encode(request["text"], add_special_tokens=False)
    return {"tokens": [int(t) for t in tokens],
            "version": f"mlx-lm {importlib.metadata.version('mlx-lm')}, mlx {importlib.metadata.version('mlx')}"}, logits

