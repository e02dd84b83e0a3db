"""The openai Python SDK through adaptive-spec: stream a reply, then read the proxy's record of it."""

import json
import urllib.request

from openai import OpenAI

BASE = "http://127.0.0.1:8088"
client = OpenAI(base_url=f"{BASE}/p/myproject/v1", api_key="local")

stream = client.chat.completions.create(
    model="local",
    messages=[{"role": "user", "content": "Write a Python function that reverses a string."}],
    temperature=0,
    stream=True,
)
for chunk in stream:
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()

with urllib.request.urlopen(f"{BASE}/adaptive/requests?limit=1") as resp:
    print(json.dumps(json.load(resp)["requests"][-1], indent=2))
