"""The conversions: convert.py (any format to any folder target through the canonical representation, and
to a file target through the sink its family provides: formats/gguf/sink.py; target_spec.py each module's
spec in the target, module_writer.py its writing), dequantize.py (to plain float folders), activation_cost.py
(what W8A8's run-time activations cost), engine.py (run: every target's one path, open, stage, write, check,
publish, report, staged atomically by formats/storage/staging.py; a folder's streaming writing), sink.py (the
Sink steps run calls, and the folder sink) and parallel.py (--jobs workers).

This package is also the Python API's verb ``qconv.convert(src, dst, to=..., ...)`` (api.convert): a verb
and the package that implements it share the name ``qconv.convert``, and a package imported after a
function of its name would replace that function on ``qconv``. So the package itself is callable (api.py
makes it so, where the verb is: the package imports nothing above it), and every import path into it
(``qconv.convert.engine``, mock targets, ``import qconv.convert.x as y``) works as for any package."""
