"""Z-Image-Turbo: two images of one prompt in one request (8 steps, no guidance).

    mstar serve z_image_turbo    # Tongyi-MAI/Z-Image-Turbo (or a diffusers directory); a GPU
    python examples/image_z_image.py [out.png] [SIZE]

``SIZE`` is ``WxH`` (default 1024x1024; multiples of 16); see docs/diffusion.md for the knobs.
"""

import base64
import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("z_image_turbo")
out = sys.argv[1] if len(sys.argv) > 1 else "z_image.png"
size = sys.argv[2] if len(sys.argv) > 2 else "1024x1024"
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none", timeout=600)

made = client.images.generate(model=MODEL, prompt="A red fox in fresh snow, morning light, photograph", size=size,
                              n=2, extra_body={"seed": 7, "num_inference_steps": 8})
for i, image in enumerate(made.data):
    path = out.removesuffix(".png") + f"_{i}.png"
    with open(path, "wb") as f:
        f.write(base64.b64decode(image.b64_json))
    print(f"wrote {path}")
