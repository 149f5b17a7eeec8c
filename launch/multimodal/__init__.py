"""Images into requests, as vLLM takes them (Qwen2-VL / Qwen2.5-VL).

image.py decodes and checks what a client sends; processor.py resizes it as the model's image
processor does; hashing.py names the result; placeholders.py expands the prompt's image
placeholders; media.py fetches image_url parts; options.py and args.py hold the limits and
their flags; inputs.py puts them together for the Python API and the HTTP server.
"""
