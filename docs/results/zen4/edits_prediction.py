"""`python docs/results/zen4/edits_prediction.py MODEL OUT.json`. Predicted outputs on a few code edits: tok/s and exactness of ar, pld, suffix with and without the file as the
prediction (one run each, interleaved)."""
import inspect, json, sys, textwrap, time
import draftwise
import torch

model_name = sys.argv[1]
torch.set_num_threads(2)
model, tokenizer = draftwise.load_model(model_name)
import textwrap as tw, json as js, shutil
sources = [inspect.getsource(tw.dedent), inspect.getsource(shutil.copyfileobj), inspect.getsource(js.dumps)[:1400]]
tasks = [
    ("Add type hints to this function. Reply with the whole function only.", 0),
    ("Rename the variable `length` to `size` in this function. Reply with the whole function only.", 1),
    ("Remove the docstring of this function. Reply with the whole function only.", 2),
]
rows = []
for instruction, index in tasks:
    code = sources[index]
    prompt = [{"role": "user", "content": f"{instruction}\n\n```python\n{code}```"}]
    plain = None
    for method in ("ar", "pld", "suffix"):
        for prediction in (None, f"```python\n{code}```"):
            started = time.perf_counter()
            result = draftwise.generate(model, tokenizer, prompt, method=method, max_new_tokens=256,
                                        prediction=prediction)
            seconds = time.perf_counter() - started
            if method == "ar" and prediction is None:
                plain = result.token_ids
            rows.append({"task": index, "method": method, "prediction": prediction is not None,
                         "tokens": len(result.token_ids), "tok_s": round(len(result.token_ids) / seconds, 1),
                         "mat": round(result.stats.mean_accepted_tokens, 2), "exact": result.token_ids == plain,
                         "accepted_prediction": result.stats.accepted_prediction_tokens})
            print(rows[-1], flush=True)
json.dump(rows, open(sys.argv[2], "w"), indent=1)
