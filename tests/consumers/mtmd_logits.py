"""Run in .venv-llamacpp (llama-cpp-python 0.3.36): llama.cpp's libmtmd and a text context evaluate one
prompt holding one image, as llama.cpp's own multimodal tools do, and save the logits at every text
position with what they were computed from.

    python mtmd_logits.py TEXT.gguf MMPROJ.gguf IMAGE.npy "PROMPT with <__media__>" OUT.npz

IMAGE.npy: uint8 [H, W, 3] RGB, handed to mtmd_bitmap_init untouched (a size llama.cpp does not resize:
sides multiples of patch * merge, within its token limits). OUT holds

    tokens     [n]            the prompt's token ids as mtmd tokenized it, -1 at the image's tokens
    positions  [n, 3]         the (t, y, x) M-RoPE position of each (text: (p, p, p); image: from mtmd)
    embd       [n_image, n_embd_inp]   the image chunk's embeddings (Qwen3-VL: merger | deepstack...)
    logits     [n_text, n_vocab]       the logits at every text position, in prompt order
    rms_eps    []             the text RMSNorm eps llama.cpp's loader reports using (print_info)

Settings chosen so that nothing but the model's arithmetic is measured: CPU, 2 threads, no warmup, flash
attention off (it casts K / V to F16), an F32 KV cache (the default F16 rounds), one ubatch per chunk.
Text chunks are decoded with every token an output (mtmd_helper_eval_chunks, which asks for the last
token's logits only, aborts in ggml_add on the tiny Qwen3-VL, whose deepstack layers include its last
layer); the image chunk through mtmd_helper_decode_image_chunk, which sets its M-RoPE positions. Run in a
process of its own: a crash in llama.cpp is a crash, not a wrong answer."""

import ctypes
import re
import sys

import llama_cpp as L
import llama_cpp.mtmd_cpp as M
import numpy as np

THREADS = 2
LOG = []


@L.llama_log_callback
def _log(level, text, user_data):
    LOG.append(text.decode("utf-8", "replace"))


def fail(what: str) -> None:
    sys.stderr.write("".join(LOG[-40:]))
    sys.exit(what)


text_path, mmproj_path, image_path, prompt, out = sys.argv[1:6]
L.llama_log_set(_log, None)
M.mtmd_log_set(_log, None)
M.mtmd_helper_log_set(_log, None)
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.n_gpu_layers = 0
model = L.llama_model_load_from_file(text_path.encode(), mp)
if not model:
    fail(f"llama.cpp could not load {text_path}")
eps = re.findall(r"f_norm_rms_eps\s*=\s*(\S+)", "".join(LOG))
n_embd = L.llama_model_n_embd_inp(model)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

cp = M.mtmd_context_params_default()
cp.use_gpu, cp.print_timings, cp.n_threads, cp.warmup = False, False, THREADS, False
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
mctx = M.mtmd_init_from_file(mmproj_path.encode(), model, cp)
if not mctx:
    fail(f"libmtmd could not load {mmproj_path}")

image = np.ascontiguousarray(np.load(image_path))
h, w, _ = image.shape
bitmap = M.mtmd_bitmap_init(w, h, (ctypes.c_uint8 * image.size).from_buffer_copy(image.tobytes()))
chunks = M.mtmd_input_chunks_init()
raw = prompt.encode()
text = M.mtmd_input_text(text=raw, text_len=len(raw), add_special=False, parse_special=True)
if M.mtmd_tokenize(mctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
    fail("mtmd_tokenize failed")

n_chunks = M.mtmd_input_chunks_size(chunks)
n_total = sum(M.mtmd_input_chunk_get_n_pos(M.mtmd_input_chunks_get(chunks, i)) for i in range(n_chunks))
cparams = L.llama_context_default_params()
cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = max(64, n_total + 8)
cparams.n_seq_max = 1
cparams.n_threads = cparams.n_threads_batch = THREADS
cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
cparams.type_k = cparams.type_v = L.GGML_TYPE_F32
cparams.no_perf = True
lctx = L.llama_init_from_model(model, cparams)
if not lctx:
    fail("llama_init_from_model failed")

tokens, positions, logits, embd = [], [], [], None
batch = L.llama_batch_ext_init(lctx)
n_past = 0
for i in range(n_chunks):
    chunk = M.mtmd_input_chunks_get(chunks, i)
    if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
        n = ctypes.c_size_t(0)
        ids = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
        if n.value == 0:
            continue
        L.llama_batch_ext_clear(batch)
        for j in range(n.value):
            k = L.llama_batch_ext_add_token(batch, 0, ids[j])
            L.llama_batch_ext_set_pos(batch, k, ctypes.byref(L.llama_pos(n_past + j)))
            L.llama_batch_ext_set_output_logits(batch, k, True)
            tokens.append(int(ids[j]))
            positions.append([n_past + j] * 3)
        if L.llama_process(lctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) != 0:
            fail("llama_process failed on a text chunk")
        logits.append(np.ctypeslib.as_array(L.llama_get_logits(lctx), shape=(n.value * n_vocab,))
                      .copy().reshape(n.value, n_vocab))
        n_past += n.value
        continue
    if embd is not None or M.mtmd_input_chunk_get_type(chunk) != M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
        fail("expected one image chunk")
    n_image = M.mtmd_input_chunk_get_n_tokens(chunk)
    if M.mtmd_encode_chunk(mctx, chunk) != 0:
        fail("mtmd_encode_chunk failed")
    embd = np.ctypeslib.as_array(M.mtmd_get_output_embd(mctx), shape=(n_image * n_embd,)).copy()
    image_tokens = M.mtmd_input_chunk_get_tokens_image(chunk)
    for j in range(n_image):
        pos = M.mtmd_image_tokens_get_decoder_pos(image_tokens, n_past, j)
        tokens.append(-1)
        positions.append([pos.t, pos.y, pos.x])
    new_n_past = L.llama_pos(0)
    if M.mtmd_helper_decode_image_chunk(mctx, lctx, chunk, (ctypes.c_float * embd.size).from_buffer(embd), n_past, 0,
                                        cparams.n_batch, ctypes.byref(new_n_past),
                                        M.mtmd_helper_post_decode_callback(), None) != 0:
        fail("mtmd_helper_decode_image_chunk failed")
    n_past = new_n_past.value
    embd = embd.reshape(n_image, n_embd)
if embd is None or not logits:
    fail("the prompt gave no image or no text")
np.savez(out, tokens=np.array(tokens), positions=np.array(positions), embd=embd, logits=np.concatenate(logits),
         rms_eps=np.float64(eps[-1]) if eps else np.nan)
L.llama_batch_ext_free(batch)
L.llama_free(lctx)
M.mtmd_input_chunks_free(chunks)
M.mtmd_bitmap_free(bitmap)
M.mtmd_free(mctx)
L.llama_model_free(model)
