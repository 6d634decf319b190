"""SingProbe without SGLang: config, reference head, checkpoint loader and binding checks."""

import math

# The key the scores travel under: SGLang's customized_info / meta_info, and the field of each
# OpenAI choice. One name for the runtime, the API patches and the guard.
SCORES_KEY = "token_probe_probs"


def json_scores(scores: list) -> list:
    """`scores` ready for a JSON body: a non-finite probability (the NaN row a failed probe step
    leaves for its request) becomes null, as SGLang's own orjson writes it; `json.dumps` would write
    `NaN`, which strict JSON parsers (browsers, Go, orjson) reject."""
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in s.items()}
            if isinstance(s, dict) else s for s in scores]
