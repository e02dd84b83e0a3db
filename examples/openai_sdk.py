"""The openai Python SDK through adaptive-spec: stream a reply, then read the proxy's record of it.

Uses OPENAI_BASE_URL and OPENAI_API_KEY when you have set them (the SDK's own variables), else the proxy's default
address with the project prefix `myproject`:

    python examples/openai_sdk.py
    OPENAI_BASE_URL=http://127.0.0.1:9000/p/myproject/v1 python examples/openai_sdk.py
"""

import json
import os
import re
import urllib.request

from openai import OpenAI

base_url = os.environ.get("OPENAI_BASE_URL") or "http://127.0.0.1:8088/p/myproject/v1"
client = OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY") or "local")
root = re.sub(r"(/p/[^/]+)?/v1/?$", "", base_url)  # adaptive-spec's own endpoints sit beside /v1

stream = client.chat.completions.create(
    model="local",
    messages=[{"role": "user", "content": "Write a Python function that reverses a string."}],
    temperature=0,
    max_tokens=400,
    stream=True,
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

with urllib.request.urlopen(f"{root}/adaptive/requests?limit=1") as resp:
    print(json.dumps(json.load(resp)["requests"][-1], indent=2))
