"""Chat with the default model (SmolLM2 on the CPU, no download), streamed, with the official
``openai`` client.

    mstar serve smollm2          # in another shell (or: make serve)
    python examples/chat_smollm2.py
"""

import openai
from _common import BASE_URL, model_name

MODEL = model_name("smollm2")

client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="none")
stream = client.chat.completions.create(
    model=MODEL,
    messages=[{"role": "user", "content": "Name the capital of France."}],
    temperature=0,
    max_tokens=32,
    stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()

# The legacy text completion, without the chat template:
completion = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                       temperature=0)
print(completion.choices[0].text)
