"""llama.cpp (llama-cpp-python, `bin/setup llamacpp`) as a consumer of a GGUF's tokenizer: load the file's
vocabulary only and tokenize each string of a JSON list as llama.cpp does for a prompt (bos added, no
special-token parsing), then detokenize the ids back.

    .venv-llamacpp/bin/python tests/consumers/llamacpp_tokenize.py FILE.gguf STRINGS.json OUT.json

OUT.json: {"ids": [[...] per string], "text": [detokenized string per string], "n_vocab": N,
"model": tokenizer.ggml.model as llama.cpp read it}.
"""

import json
import sys


def main() -> int:
    import llama_cpp

    path, strings, out = sys.argv[1:4]
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    texts = json.loads(open(strings, encoding="utf-8").read())
    ids = [llm.tokenize(t.encode("utf-8"), add_bos=True, special=False) for t in texts]
    back = [llm.detokenize(i).decode("utf-8", errors="replace") for i in ids]
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"ids": ids, "text": back, "n_vocab": llm.n_vocab(),
                   "model": llm.metadata.get("tokenizer.ggml.model")}, f, ensure_ascii=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
