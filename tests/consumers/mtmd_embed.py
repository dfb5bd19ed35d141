"""Run in .venv-llamacpp (llama-cpp-python 0.3.36): llama.cpp's libmtmd loads a text GGUF and its mmproj
file, encodes fixed RGB images and saves the image embeddings it would feed the text model.

    python mtmd_embed.py TEXT.gguf MMPROJ.gguf WxH[,WxH...] OUT.npz

Each image is uint8 noise drawn with numpy's default_rng(W * 1000 + H) (the test draws the same), of a
size llama.cpp does not resize (a multiple of patch * merge, within its token limits), so both sides see
the same pixels. OUT holds img_WxH (the image) and embd_WxH ([tokens, n_embd_inp]) per size. Run in a
process of its own: a crash in llama.cpp is a crash, not a wrong answer."""

import ctypes
import sys

import llama_cpp
import llama_cpp.mtmd_cpp as mtmd
import numpy as np

text, mmproj, sizes, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
llama_cpp.llama_backend_init()
mp = llama_cpp.llama_model_default_params()
mp.n_gpu_layers = 0
model = llama_cpp.llama_model_load_from_file(text.encode(), mp)
if not model:
    sys.exit(f"llama.cpp could not load {text}")
cp = mtmd.mtmd_context_params_default()
cp.use_gpu, cp.n_threads, cp.warmup = False, 2, False
ctx = mtmd.mtmd_init_from_file(mmproj.encode(), model, cp)
if not ctx:
    sys.exit(f"libmtmd could not load {mmproj}")
n_embd = llama_cpp.llama_model_n_embd_inp(model)
result = {}
for size in sizes.split(","):
    w, h = (int(v) for v in size.split("x"))
    image = np.random.default_rng(w * 1000 + h).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    bitmap = mtmd.mtmd_bitmap_init(w, h, (ctypes.c_uint8 * image.size).from_buffer_copy(image.tobytes()))
    chunks = mtmd.mtmd_input_chunks_init()
    marker = mtmd.mtmd_default_marker()
    prompt = mtmd.mtmd_input_text()
    prompt.text, prompt.text_len, prompt.add_special, prompt.parse_special = marker, len(marker), False, True
    if mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(prompt), (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) != 0:
        sys.exit(f"mtmd_tokenize failed for {size}")
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        chunk = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            continue
        tokens = mtmd.mtmd_image_tokens_get_n_tokens(mtmd.mtmd_input_chunk_get_tokens_image(chunk))
        if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
            sys.exit(f"mtmd_encode_chunk failed for {size}")
        embd = np.ctypeslib.as_array(mtmd.mtmd_get_output_embd(ctx), shape=(tokens * n_embd,))
        result[f"embd_{size}"] = embd.copy().reshape(tokens, n_embd)
        result[f"img_{size}"] = image
    mtmd.mtmd_input_chunks_free(chunks)
    mtmd.mtmd_bitmap_free(bitmap)
mtmd.mtmd_free(ctx)
np.savez(out, **result)
