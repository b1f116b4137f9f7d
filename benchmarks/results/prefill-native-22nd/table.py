import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"] if isinstance(d, dict) else d
for r in rows:
    if r.get("op") in ("prefill", "chunked_prefill", "spec_decode"):
        if r["impl"] in ("kvfuse_pages", "kvfuse_partials", "kvfuse_paged_prefix"):
            continue
        print(f'{r["op"]:16s} {str(r.get("kv_cache_dtype")):6s} {r.get("context")} {r["impl"]:20s} {r.get("us")} {r.get("tflops")} {r.get("us_rounds")} {r.get("error", "")[:60]}')
