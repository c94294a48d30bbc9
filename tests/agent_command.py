"""An agent run as a command (`rl.agent.command`), as one written elsewhere would be: the row on stdin, the model
behind `OPENAI_BASE_URL` (which the `openai` client reads itself), the reward as its last line of output.

    python tests/agent_command.py [fail | hang]
"""

from __future__ import annotations

import json
import sys
import time

import openai

if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
    row = json.loads(sys.stdin.read())
    if mode == "hang":
        time.sleep(3600)
    client = openai.OpenAI(max_retries=0)  # base URL and key from OPENAI_BASE_URL / OPENAI_API_KEY
    reply = client.chat.completions.create(
        model="temper", messages=[{"role": "user", "content": row["prompt"]}], max_tokens=8
    )
    if mode == "fail":
        sys.exit("the agent's own error")
    print("a log line before the reward")
    print(json.dumps({"called": 1.0, "length": len(reply.choices[0].message.content or "") % 3}))
