"""Ask a Qwen3.5 vision-language model about an image (an ``image_url`` content part carrying a
data URI), streamed, with thinking switched off.

    mstar serve qwen3_5_0_8b     # Qwen/Qwen3.5-0.8B from the HF cache; the larger keys want a GPU
    python examples/chat_qwen3_5.py [photo.png]

``MSTAR_MODEL`` picks another size (``qwen3_5_9b``, ...). Without a file the script draws a
small picture of its own (a red square on white).
"""

import base64
import io
import sys

import openai
from _common import BASE_URL, model_name
from PIL import Image

MODEL = model_name("qwen3_5_0_8b")


def image_data_uri(path: str | None) -> str:
    if path:
        with open(path, "rb") as f:
            data, kind = f.read(), path.rsplit(".", 1)[-1].lower().replace("jpg", "jpeg")
    else:
        picture = Image.new("RGB", (128, 128), "white")
        picture.paste((220, 20, 20), (32, 32, 96, 96))
        buffer = io.BytesIO()
        picture.save(buffer, "PNG")
        data, kind = buffer.getvalue(), "png"
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
stream = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image_data_uri(sys.argv[1] if len(sys.argv) > 1 else None)}},
        {"type": "text", "text": "What is in this picture? One sentence."},
    ]}],
    max_tokens=64,
    temperature=0,
    stream=True,
    extra_body={"enable_thinking": False},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
