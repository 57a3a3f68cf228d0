"""How often the managed simulator's replies parse: `userrl eval --config configs/usersim_cpu.yaml` on the simulator
gyms, with a scripted policy that puts something to the simulator in every turn (the config's 135M policy, greedy,
runs past its token limit and asks nothing). The policy is a local OpenAI-compatible server (`eval.endpoint`): a
question, a guess in Telepathy's and Turtle's second turn, a search then answers in SearchGym. The counts are in
`OUT/report.md` ("user simulator calls") and `OUT/results.json` (`user_sim`); docs/results.md, "The managed 135M
simulator". In tau2's telecom (`--config configs/tau2_telecom_cpu.yaml --gyms tau2_telecom`) the policy looks the
customer up with an agent tool, then asks the user to act on their phone: both parties call tools.

    python tools/usersim_parse_rates.py --out runs/eval/parse --tasks 4 --max-turns 3 [key=value ...]
    python tools/usersim_parse_rates.py --config configs/tau2_telecom_cpu.yaml --gyms tau2_telecom \
        --out runs/eval/telecom --tasks 4 --max-turns 2
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.openai_server import Answer, OpenAIServer, tool_call  # noqa: E402

GYMS = "intention,persuade,telepathy,turtle,travel,search"
QUESTIONS = ("Is it something you can eat?", "Could you tell me more about what you want?", "Is it bigger than a car?")
CORPUS = {"title": "Kiwi", "text": "The kiwi is a flightless bird of New Zealand."}  # SearchGym's offline search


TELECOM_LOOKUP = ("get_customer_by_phone", {"phone_number": "555-123-2002"})
TELECOM_ASK = "Please check your phone: turn airplane mode off, then tell me what the status bar shows."


def policy(body: dict[str, Any]) -> Answer:
    system = str(body["messages"][0]["content"])
    turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
    if any(t["function"]["name"] == TELECOM_LOOKUP[0] for t in body.get("tools") or []):  # tau2's telecom agent
        return tool_call(*TELECOM_LOOKUP) if turn == 1 else Answer(TELECOM_ASK)  # turn 0 is the greeting
    if "SearchGym is a question answering environment" in system:
        choice, content = [("search", "kiwi bird"), ("answer", "Paris"), ("answer", "New Zealand")][turn % 3]
        return tool_call("interact_with_env", {"choice": choice, "content": content})
    if ("TelepathyGym" in system or "TurtleGym" in system) and turn == 1:
        return tool_call("interact_with_env", {"choice": "answer", "content": "It is an apple."})
    return tool_call("interact_with_env", {"choice": "action", "content": QUESTIONS[turn % len(QUESTIONS)]})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="configs/usersim_cpu.yaml")
    parser.add_argument("--gyms", default=GYMS)
    parser.add_argument("--tasks", default="4")
    parser.add_argument("--max-turns", default="3")
    args, overrides = parser.parse_known_args()
    corpus = Path(args.out + ".corpus.jsonl")
    corpus.parent.mkdir(parents=True, exist_ok=True)
    corpus.write_text(json.dumps(CORPUS) + "\n")
    with OpenAIServer(policy) as server:
        command = [
            sys.executable, "-m", "userrl_megatron", "eval", "--config", args.config, "--no-plot",
            "--out", args.out, "--gyms", args.gyms, "--tasks", args.tasks, "--samples", "1",
            "--max-turns", args.max_turns, "--endpoint", server.base_url, "--api-model", "scripted",
            "eval.api_key_env=none", f"gyms.search.corpus_path={corpus}", "eval.retries=0", *overrides,
        ]  # fmt: skip
        return subprocess.run(command, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
