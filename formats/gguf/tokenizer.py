"""The tokenizer llama.cpp reads, both ways: a Hugging Face folder's tokenizer (a byte-level BPE
tokenizer.json as llama.cpp's "gpt2" model, a SentencePiece tokenizer.model as its "llama" model) as the
GGUF metadata llama.cpp's converter writes (convert_hf_to_gguf.py: get_vocab_base,
_create_vocab_sentencepiece, gguf.SpecialVocab), and a GGUF's tokenizer metadata rebuilt into
tokenizer.json and tokenizer_config.json for a folder read back from it. Reads JSON and
tokenizer.model only (no tensor data).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

from ..core.structure import text_config
from ...errors import CorruptCheckpoint, UnsupportedFormat
from ..storage.checkpoint import load_json

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5

# tokenizer.json pre-tokenizer regexes -> llama.cpp's pre-tokenizer names (llama-vocab.cpp), for the
# tokenizers whose regex says which it is; ByteLevel's own regex is GPT-2's.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_PRE_BY_REGEX = {
    _GPT2_REGEX: "gpt-2",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "llama-bpe",
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+":
        "qwen2",
}


def _pre_name(tok: Mapping, where) -> str:
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if step.get("type") == "Split":
            regex = (step.get("pattern") or {}).get("Regex")
            if regex in _PRE_BY_REGEX:
                return _PRE_BY_REGEX[regex]
            raise UnsupportedFormat(f"its pre-tokenizer regex is not one qconv maps to a llama.cpp pre-tokenizer "
                                    f"({str(regex)[:60]!r}...); nothing written", file=where)
        if step.get("type") == "ByteLevel" and step.get("use_regex", True):
            return "gpt-2"
    raise UnsupportedFormat("its pre-tokenizer is not one qconv maps to a llama.cpp pre-tokenizer; nothing written",
                            file=where)


def sentencepiece_style(tok: Mapping) -> bool:
    """A tokenizer.json converted from a SentencePiece model (transformers' LlamaTokenizerFast: Metaspace,
    a "▁" normalizer, byte fallback, or a Unigram model): llama.cpp's "llama" vocab, from tokenizer.model."""
    model = tok.get("model") if isinstance(tok.get("model"), dict) else {}
    steps = []
    for part in ("pre_tokenizer", "normalizer"):
        step = tok.get(part) if isinstance(tok.get(part), dict) else {}
        steps += [step] + [s for s in step.get("pretokenizers", step.get("normalizers", [])) if isinstance(s, dict)]
    return (model.get("type") == "Unigram" or model.get("byte_fallback") is True
            or any(s.get("type") == "Metaspace" or (s.get("type") in ("Prepend", "Replace") and "\u2581" in
                                                       json.dumps(s, ensure_ascii=False)) for s in steps))


def tokenizer(folder: Path, config: Mapping, root) -> list[tuple[str, str, object]]:
    """The tokenizer metadata llama.cpp reads, as llama.cpp's converter writes it: a byte-level BPE
    tokenizer.json as llama.cpp's "gpt2" model (_gpt2_tokenizer); a SentencePiece tokenizer.model (with no
    tokenizer.json, or beside one converted from it) as its "llama" model (_sentencepiece_tokenizer)."""
    path, model_path = folder / "tokenizer.json", folder / "tokenizer.model"
    tok = load_json(path, what="tokenizer.json") if root.check(path, "tokenizer") == "file" else None
    if isinstance(tok, dict) and sentencepiece_style(tok) or tok is None:
        if root.check(model_path, "tokenizer.model") == "file":
            return _sentencepiece_tokenizer(folder, config, root, tok)
        if tok is not None:
            raise UnsupportedFormat("tokenizer.json is a SentencePiece-style tokenizer (Metaspace, byte fallback: "
                                    "llama.cpp's 'llama' vocab), which qconv writes from the model's tokenizer.model; "
                                    "put tokenizer.model beside it; nothing written", file=path)
        raise UnsupportedFormat("has no tokenizer.json or tokenizer.model, which llama.cpp's GGUF needs (qconv maps "
                                "byte-level BPE tokenizer.json and SentencePiece BPE tokenizer.model); nothing written",
                                file=folder)
    return _gpt2_tokenizer(folder, config, root, tok, path)


def _gpt2_tokenizer(folder: Path, config: Mapping, root, tok, path: Path) -> list[tuple[str, str, object]]:
    """tokenizer.json (a byte-level BPE: llama.cpp's "gpt2" model) and tokenizer_config.json, as
    convert_hf_to_gguf's get_vocab_base and gguf.SpecialVocab write them: tokens padded to the model's
    vocab_size with [PADn] (UNUSED), added special tokens CONTROL, other added tokens USER_DEFINED, merges
    as "a b", bos / eos / unk / pad ids, add_bos, the chat template."""
    model = tok.get("model") if isinstance(tok, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise UnsupportedFormat("tokenizer.json is not a BPE tokenizer, the only kind qconv maps to GGUF; "
                                "nothing written", file=path)
    pre = _pre_name(tok, path)
    config = text_config(config)
    vocab = {}
    for t, i in model["vocab"].items():
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise CorruptCheckpoint(f"tokenizer.json gives token {t!r} the id {i!r}, not a token id; nothing written",
                                    file=path)
        if i in vocab:
            raise CorruptCheckpoint(f"tokenizer.json gives tokens {vocab[i]!r} and {t!r} the same id {i}; nothing "
                                    f"written", file=path)
        vocab[i] = t
    added = {}
    for a in tok.get("added_tokens") or []:
        i = a.get("id") if isinstance(a, dict) else None
        if isinstance(i, bool) or not isinstance(i, int) or i < 0 or not isinstance(a.get("content"), str):
            raise CorruptCheckpoint(f"tokenizer.json's added token {a!r} has no token id and content; nothing "
                                    f"written", file=path)
        if i in added:
            raise CorruptCheckpoint(f"tokenizer.json gives added tokens {added[i]['content']!r} and "
                                    f"{a['content']!r} the same id {i}; nothing written", file=path)
        added[i] = a
    for i, a in added.items():
        vocab[i] = a["content"]
    size = int(config.get("vocab_size") or (max(vocab) + 1))
    if max(vocab, default=-1) >= size:
        raise UnsupportedFormat(f"tokenizer.json has token ids up to {max(vocab)}, beyond vocab_size {size}; "
                                f"nothing written", file=path)
    tokens, types = [], []
    for i in range(size):
        if i not in vocab:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(vocab[i])
            types.append(CONTROL if added[i].get("special") else USER_DEFINED)
        else:
            tokens.append(vocab[i])
            types.append(NORMAL)
    known = set(model["vocab"])
    for m in model.get("merges") or []:               # tokenizers' BPE refuses these too ("out of vocabulary")
        parts = m.split(" ") if isinstance(m, str) else m
        if not isinstance(parts, list) or len(parts) != 2 or not all(isinstance(p, str) for p in parts) \
                or not all(p in known for p in parts + ["".join(parts)]):
            raise CorruptCheckpoint(f"tokenizer.json's merge {m!r} is not two tokens of its vocabulary merging "
                                    f"into a third; nothing written", file=path)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    steps = [tok.get("pre_tokenizer") or {}]
    steps += steps[0].get("pretokenizers", []) if steps[0].get("type") == "Sequence" else []
    prefix = any(st.get("type") == "ByteLevel" and st.get("add_prefix_space") for st in steps)
    kv = [("tokenizer.ggml.model", "str", "gpt2"), ("tokenizer.ggml.pre", "str", pre),
          ("tokenizer.ggml.add_space_prefix", "bool", prefix),
          ("tokenizer.ggml.tokens", "str[]", tokens), ("tokenizer.ggml.token_type", "i32[]", types),
          ("tokenizer.ggml.merges", "str[]", merges)]
    tc = _tokenizer_config(folder, root)
    return kv + _special_tokens(tc, {t: i for i, t in vocab.items()}, config) + _add_and_template(tc, folder, root)


def _tokenizer_config(folder: Path, root) -> dict:
    tc_path = folder / "tokenizer_config.json"
    tc = load_json(tc_path, what="tokenizer_config.json") if root.check(tc_path) == "file" else {}
    return tc if isinstance(tc, dict) else {}


def _special_tokens(tc: Mapping, ids: Mapping[str, int], config: Mapping,
                    fallback: Mapping[str, int] | None = None) -> list[tuple[str, str, object]]:
    """bos / eos / unk / pad ids as gguf.SpecialVocab finds them: tokenizer_config.json's token by its
    content, else config.json's *_token_id (else ``fallback``'s)."""
    kv = []
    for kind in ("bos", "eos", "unk", "pad"):
        value = tc.get(f"{kind}_token")
        value = value.get("content") if isinstance(value, dict) else value
        tid = ids.get(value) if isinstance(value, str) else None
        if tid is None and isinstance(config.get(f"{kind}_token_id"), int):
            tid = config[f"{kind}_token_id"]
        if tid is None and fallback:
            tid = fallback.get(kind)
        if tid is not None:
            kv.append((ID_KEYS[kind], "u32", int(tid)))
    return kv


# llama.cpp's keys for the special ids (gguf-py's Keys.Tokenizer); qconv before 2026-12-05 wrote the pad id
# as tokenizer.ggml.pad_token_id, which llama.cpp does not read, and still reads it back
ID_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
           "unk": "tokenizer.ggml.unknown_token_id", "pad": "tokenizer.ggml.padding_token_id"}


def special_id(meta: Mapping, kind: str):
    """A GGUF's bos / eos / unk / pad id (None where it has none)."""
    tid = meta.get(ID_KEYS[kind])
    return meta.get("tokenizer.ggml.pad_token_id") if tid is None and kind == "pad" else tid


def _add_and_template(tc: Mapping, folder: Path, root, add: Mapping[str, bool] | None = None) -> list:
    """add_bos / add_eos (``add``'s, else tokenizer_config.json's) and the chat template
    (tokenizer_config.json's, else chat_template.jinja), as gguf.SpecialVocab writes them."""
    kv = []
    for kind in ("bos", "eos"):
        value = (add or {}).get(kind, tc.get(f"add_{kind}_token"))
        if isinstance(value, bool):
            kv.append((f"tokenizer.ggml.add_{kind}_token", "bool", value))
    template = tc.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if template is None and root.check(jinja) == "file":
        template = jinja.read_text(encoding="utf-8")
    if isinstance(template, str):
        kv.append(("tokenizer.chat_template", "str", template))
    return kv


def _sentencepiece_tokenizer(folder: Path, config: Mapping, root, tok) -> list[tuple[str, str, object]]:
    """tokenizer.model as llama.cpp's "llama" model, as convert_hf_to_gguf's _create_vocab_sentencepiece,
    _set_vocab_sentencepiece and LlamaModel.set_vocab write it: each piece, its score and its type (the
    piece types are llama.cpp's token types), padded to the model's vocab_size with [PADn] (score -10000,
    UNUSED); added_tokens.json's tokens USER_DEFINED, tokenizer_config.json's added_tokens_decoder's
    CONTROL where special (or looking special: <|...|>) and USER_DEFINED otherwise ("▁" as a space), each
    with score -1000; pre "default"; bos / eos / unk / pad ids, add_bos / add_eos, the chat template.

    Where the converter and sentencepiece disagree, this follows what makes llama.cpp tokenize as
    sentencepiece does:
    - a USER_DEFINED piece stays USER_DEFINED (the converter writes NORMAL, and llama.cpp would then break
      it up instead of matching it whole, as sentencepiece does);
    - add_space_prefix is the model's add_dummy_prefix (the converter writes none, so llama.cpp always
      prepends a space), or tokenizer_config.json's add_prefix_space where it has one (as the converter);
    - pieces past vocab_size are refused (the converter drops them with a warning: ids the model has no
      embedding row for); models llama.cpp cannot tokenize alike (Unigram, text normalization, collapsed
      whitespace) are refused (spm.check_llama_cpp_can_tokenize);
    - where tokenizer_config.json names no bos / eos / unk / pad token by a content the vocab has, nor
      config.json by id, the model's own ids (trainer_spec) are written (the converter writes none, and
      llama.cpp then assumes Llama's 1 / 2 / 0); the converter finds names only among tokenizer.json's
      added tokens, which are pieces here too, so real folders get the same ids;
    - a transformers-5 folder keeps its added tokens only in tokenizer.json: where tokenizer_config.json
      has no added_tokens_decoder, tokenizer.json's added_tokens stand for it (the converter would leave
      those ids [PADn])."""
    from . import spm

    model_path = folder / "tokenizer.model"
    model = spm.read_model(model_path)
    spm.check_llama_cpp_can_tokenize(model, model_path)
    config = text_config(config)
    n = len(model.pieces)
    size = int(config.get("vocab_size") or n)
    if n > size:
        raise UnsupportedFormat(f"SentencePiece model has {n} pieces, more than the model's vocab_size {size}; "
                                f"nothing written", file=model_path)
    tokens = list(model.pieces) + [f"[PAD{i}]" for i in range(n, size)]
    scores = list(model.scores) + [-10000.0] * (size - n)
    types = list(model.types) + [UNUSED] * (size - n)
    added_path = folder / "added_tokens.json"
    if root.check(added_path, "added_tokens.json") == "file":
        added = load_json(added_path, what="added_tokens.json")
        if not isinstance(added, dict) or not all(isinstance(i, int) and i >= 0 for i in added.values()):
            raise CorruptCheckpoint("added_tokens.json must map each token to its id", file=added_path)
        for content, i in added.items():
            if i < size:                              # the converter skips ids past vocab_size with a warning
                tokens[i], scores[i], types[i] = content, -1000.0, USER_DEFINED
    tc = _tokenizer_config(folder, root)
    decoder = tc.get("added_tokens_decoder")
    if decoder is None:
        decoder = {a.get("id"): a for a in tok.get("added_tokens") or [] if isinstance(a, dict)} \
            if isinstance(tok, dict) else {}
    where = folder / ("tokenizer_config.json" if "added_tokens_decoder" in tc else "tokenizer.json")
    if not isinstance(decoder, dict):
        raise CorruptCheckpoint("added_tokens_decoder must map ids to tokens", file=where)
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(content, str) or not str(key).isdigit():
            raise CorruptCheckpoint(f"added token {key!r} has no id and content", file=where)
        i = int(key)
        if i >= size:
            continue
        if entry.get("special") or _looks_special(content):
            types[i] = CONTROL
        else:
            content, types[i] = content.replace("\u2581", " "), USER_DEFINED     # pre-normalized user-defined spaces
        tokens[i], scores[i] = content, -1000.0
    prefix = tc.get("add_prefix_space")
    kv = [("tokenizer.ggml.model", "str", "llama"), ("tokenizer.ggml.pre", "str", "default"),
          ("tokenizer.ggml.add_space_prefix", "bool", prefix if isinstance(prefix, bool) else model.add_dummy_prefix),
          ("tokenizer.ggml.tokens", "str[]", tokens), ("tokenizer.ggml.scores", "f32[]", scores),
          ("tokenizer.ggml.token_type", "i32[]", types)]
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    own = {k: i for k, i in model.special_ids if 0 <= i < size}
    return kv + _special_tokens(tc, ids, config, own) + _add_and_template(tc, folder, root, _post_processor(tok, tc))


def _looks_special(token: str) -> bool:
    """convert_hf_to_gguf's does_token_look_special: added tokens some models leave unmarked."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))


def _post_processor(tok, tc: Mapping) -> dict[str, bool]:
    """add_bos / add_eos from tokenizer.json's TemplateProcessing, which gguf.SpecialVocab prefers to
    tokenizer_config.json's add_*_token: whether its single-sequence template starts with the bos token
    and ends with the eos token (where it has a special token there)."""
    post = tok.get("post_processor") if isinstance(tok, dict) else None
    if not isinstance(post, dict):
        return {}
    add = {}
    for proc in post.get("processors", [post]) if isinstance(post.get("processors", [post]), list) else []:
        single = proc.get("single") if isinstance(proc, dict) and proc.get("type") == "TemplateProcessing" else None
        if not isinstance(single, list) or len(single) < 2:
            continue
        names = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in tc.items() if k in ("bos_token", "eos_token")}
        first, last = (x.get("SpecialToken", {}).get("id") if isinstance(x, dict) else None for x in (single[0], single[-1]))
        if first:
            add["bos"] = first == names.get("bos_token")
        if last:
            add["eos"] = last == names.get("eos_token")
    return add


_PRE_SPLIT = {v: k for k, v in _PRE_BY_REGEX.items() if v != "gpt-2"}


def tokenizer_warning(meta: Mapping) -> str | None:
    """What a folder read back from a GGUF lacks: a tokenizer qconv does not rebuild (a model other than
    llama.cpp's "gpt2" and "llama"); None where tokenizer_files() rebuilds it or the file has none."""
    model = meta.get("tokenizer.ggml.model")
    if model in (None, "gpt2", "llama"):
        return None
    return (f"its tokenizer model {model!r} is not one qconv rebuilds into tokenizer files: the folder has no "
            f"tokenizer; copy the original model's tokenizer files into it")


def tokenizer_files(meta: Mapping, where) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json rebuilt from a GGUF's byte-level BPE tokenizer (llama.cpp's
    "gpt2" model): the inverse of tokenizer(): [PADn] padding (UNUSED) left out, CONTROL tokens as special
    added tokens, USER_DEFINED as plain added tokens; a "llama" (SentencePiece) one: _llama_tokenizer_json.
    {} where the file has no tokenizer of those kinds (tokenizer_warning says so)."""
    if meta.get("tokenizer.ggml.model") == "llama":
        return {"tokenizer.json": _llama_tokenizer_json(meta), "tokenizer_config.json": _tokenizer_config_of(meta)}
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return {}
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    merges = meta.get("tokenizer.ggml.merges") or []
    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre != "gpt-2" and pre not in _PRE_SPLIT:
        raise UnsupportedFormat(f"its tokenizer's pre-tokenizer {pre!r} is not one qconv maps back to "
                                f"tokenizer.json; nothing written", file=where)
    vocab, added = {}, []
    for i, t in enumerate(tokens):
        kind = types[i] if i < len(types) else NORMAL
        if kind == UNUSED:
            continue
        vocab[t] = i
        if kind in (CONTROL, USER_DEFINED):
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": kind == USER_DEFINED, "special": kind == CONTROL})
    byte_level = {"type": "ByteLevel", "add_prefix_space": bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
                  "trim_offsets": True, "use_regex": pre == "gpt-2"}
    unk = special_id(meta, "unk")
    unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    if pre == "gpt-2":
        pre_tok = byte_level
    else:
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": _PRE_SPLIT[pre]}, "behavior": "Isolated", "invert": False},
            byte_level]}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": pre_tok, "post_processor": None,
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": vocab, "merges": [m.split(" ", 1) for m in merges]}}
    return {"tokenizer.json": tok, "tokenizer_config.json": _tokenizer_config_of(meta)}


def _tokenizer_config_of(meta: Mapping) -> dict:
    """tokenizer_config.json from a GGUF's special ids, add_bos / add_eos and chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    tc = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for kind in ("bos", "eos", "unk", "pad"):
        tid = special_id(meta, kind)
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            tc[f"{kind}_token"] = tokens[tid]
    for kind in ("bos", "eos"):
        if isinstance(meta.get(f"tokenizer.ggml.add_{kind}_token"), bool):
            tc[f"add_{kind}_token"] = meta[f"tokenizer.ggml.add_{kind}_token"]
    if isinstance(meta.get("tokenizer.chat_template"), str):
        tc["chat_template"] = meta["tokenizer.chat_template"]
    return tc


def _llama_tokenizer_json(meta: Mapping) -> dict:
    """tokenizer.json for llama.cpp's "llama" vocabulary, as transformers' LlamaConverter makes one from a
    SentencePiece BPE model (Llama-2's tokenizer.json): a BPE model with byte fallback over every piece
    but the [PADn] padding (UNUSED), its merges every split of a NORMAL piece into two pieces, in the
    order of the merged piece's score (SentencePieceExtractor); a "▁" prepended (add_space_prefix) and
    spaces as "▁" by the normalizer; CONTROL, UNKNOWN and USER_DEFINED tokens added (the first two
    special); bos (and eos) added as add_bos / add_eos say (llama.cpp's defaults: bos yes, eos no).
    Tested: the same ids as sentencepiece on the fixture's strings, but text that spells a special token
    (<s>), which transformers matches as the token."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    scores = meta.get("tokenizer.ggml.scores") or []
    kind = [types[i] if i < len(types) else NORMAL for i in range(len(tokens))]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if kind[i] != UNUSED:
            vocab.setdefault(t, i)
    ranked = []
    for i, t in enumerate(tokens):
        if kind[i] != NORMAL or vocab.get(t) != i:
            continue
        splits = sorted(((t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab),
                        key=lambda p: (vocab[p[0]], vocab[p[1]]))
        score = float(scores[i]) if i < len(scores) else 0.0
        ranked += [(-score, i, n, list(p)) for n, p in enumerate(splits)]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": kind[i] == USER_DEFINED, "special": kind[i] != USER_DEFINED}
             for i, t in enumerate(tokens) if kind[i] in (CONTROL, UNKNOWN, USER_DEFINED)]
    unk = special_id(meta, "unk")
    unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    norm = [{"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]
    decoders = [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if meta.get("tokenizer.ggml.add_space_prefix", True):   # llama.cpp's default for "llama"
        norm.insert(0, {"type": "Prepend", "prepend": "\u2581"})
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    ends, special = {}, {}
    for kind_, default in (("bos", True), ("eos", False)):
        tid = special_id(meta, kind_)
        if meta.get(f"tokenizer.ggml.add_{kind_}_token", default) and isinstance(tid, int) and 0 <= tid < len(tokens):
            ends[kind_] = tokens[tid]
            special[tokens[tid]] = {"id": tokens[tid], "ids": [tid], "tokens": [tokens[tid]]}

    def template(seq: str, type_id: int) -> list:
        return ([{"SpecialToken": {"id": ends["bos"], "type_id": type_id}}] if "bos" in ends else []) + \
            [{"Sequence": {"id": seq, "type_id": type_id}}] + \
            ([{"SpecialToken": {"id": ends["eos"], "type_id": type_id}}] if "eos" in ends else [])

    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": norm}, "pre_tokenizer": None,
            "post_processor": {"type": "TemplateProcessing", "single": template("A", 0),
                               "pair": template("A", 0) + template("B", 1), "special_tokens": special},
            "decoder": {"type": "Sequence", "decoders": decoders},
            "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                      "vocab": vocab, "merges": [p for *_, p in sorted(ranked)]}}
