"""FLUX.2 [klein]: make an image from a prompt, then edit it (the first image as the reference).

    mstar serve flux2_klein      # black-forest-labs/FLUX.2-klein-4B (or a diffusers directory); a GPU
    python examples/image_flux2.py [out.png] [SIZE]

``SIZE`` is ``WxH`` (default 1024x1024; multiples of 16). ``MSTAR_MODEL`` picks
``flux2_klein_9b`` or ``flux2_klein_base`` (guided, 50 steps). ``seed`` and
``num_inference_steps`` are extra fields; see docs/diffusion.md.
"""

import base64
import sys

import openai
from _common import BASE_URL, model_name

MODEL = model_name("flux2_klein")
out = sys.argv[1] if len(sys.argv) > 1 else "flux2.png"
size = sys.argv[2] if len(sys.argv) > 2 else "1024x1024"
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none", timeout=600)

made = client.images.generate(model=MODEL, prompt="A lighthouse on a cliff at sunset, oil painting", size=size,
                              extra_body={"seed": 42})
png = base64.b64decode(made.data[0].b64_json)
with open(out, "wb") as f:
    f.write(png)
print(f"wrote {out}")

edit_out = out.removesuffix(".png") + "_edited.png"
edited = client.images.edit(model=MODEL, image=("ref.png", png, "image/png"),
                            prompt="The same lighthouse at night under a full moon", size=size,
                            extra_body={"seed": 42})
with open(edit_out, "wb") as f:
    f.write(base64.b64decode(edited.data[0].b64_json))
print(f"wrote {edit_out}")
