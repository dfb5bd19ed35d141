"""The model-level check's runner for GGUF files (the gguf dialect's Engine; model_check/runner.py loads
it in the Python that has llama-cpp-python and speaks the protocol; never imports qconv): llama.cpp's
next-token logits at every position, the ids evaluated as they are, and llama.cpp's own tokenization of
the text without BOS or special tokens."""


def run(model: str, request: dict) -> tuple[dict, object]:
    import llama_cpp
    import numpy as np

    ids = request["ids"]
    llm = llama_cpp.Llama(model_path=model, n_ctx=max(32, len(ids)), n_batch=max(32, len(ids)),
                          logits_all=True, verbose=False, n_threads=request.get("threads"), seed=0)
    tokens = llm.tokenize(request["text"].encode("utf-8"), add_bos=False, special=False)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    return {"tokens": [int(t) for t in tokens],
            "version": f"llama-cpp-python {llama_cpp.__version__}"}, logits

