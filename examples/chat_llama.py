"""Chat with any Llama checkpoint (``llama``: an HF id, a directory or a .gguf file), streamed,
then the same model as a plain text completion.

    mstar serve llama --config my_llama.yaml   # model_path: meta-llama/Llama-3.2-1B-Instruct, say
    python examples/chat_llama.py

The YAML names the weights (``model: llama`` and ``model_path: ...``); a small Llama runs on
the CPU, a large one wants a GPU (``device: cuda``).
"""

import openai
from _common import BASE_URL, model_name

MODEL = model_name("llama")
client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")

stream = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "system", "content": "Answer in one sentence."},
              {"role": "user", "content": "Why is the sky blue?"}],
    temperature=0.7,
    top_p=0.9,
    max_tokens=40,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    if chunk.usage:
        print(f"\n[{chunk.usage.prompt_tokens} prompt + {chunk.usage.completion_tokens} completion tokens]")

completion = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                       extra_body={"seed": 1})
print(completion.choices[0].text)
