"""Multi-turn conversations against a running server: mean accepted tokens of later turns, with and without the
x-session-id header (run once per server configuration)."""
import asyncio, json, sys, time
import aiohttp
from draftwise.bench.prompts import load_spec_bench

url, label, use_session = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
questions = [p.text for p in load_spec_bench(None, per_category=2)][:8]
follow_ups = ["Rewrite your answer so that it is shorter.", "Now list the main points of your answer as bullet points."]

async def conversation(session: aiohttp.ClientSession, index: int, question: str):
    messages = [{"role": "user", "content": question}]
    turns = []
    for turn in range(3):
        headers = {"x-session-id": f"conversation-{index}"} if use_session else {}
        body = {"model": "smollm2-135m", "messages": messages, "max_tokens": 128, "temperature": 0}
        async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as response:
            answer = await response.json()
        text = answer["choices"][0]["message"]["content"]
        stats = answer["draftwise"]
        turns.append({"turn": turn, "replica": response.headers.get("x-draftwise-replica"), "tokens": answer["usage"]["completion_tokens"],
                      "steps": stats["steps"], "accepted": stats["accepted_tokens"]})
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_ups[turn] if turn < 2 else ""}]
        messages = messages[:-1] if turn == 2 else messages
    return turns

async def main():
    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1200)) as session:
        results = await asyncio.gather(*(conversation(session, i, q) for i, q in enumerate(questions)))
    wall = time.perf_counter() - started
    summary = {"label": label, "wall_s": round(wall, 1)}
    for turn in range(3):
        rows = [c[turn] for c in results]
        tokens = sum(r["tokens"] for r in rows); steps = sum(r["steps"] for r in rows)
        summary[f"turn{turn}_mat"] = round(tokens / steps, 3)
    later = [r for c in results for r in c[1:]]
    summary["later_turns_mat"] = round(sum(r["tokens"] for r in later) / sum(r["steps"] for r in later), 3)
    summary["sticky_conversations"] = sum(len({r["replica"] for r in c}) == 1 for c in results)
    summary["tokens_per_s"] = round(sum(r["tokens"] for c in results for r in c) / wall, 1)
    print(json.dumps(summary))

asyncio.run(main())
