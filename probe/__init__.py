"""SingProbe without SGLang: config, reference head, checkpoint loader and binding checks."""

# The key the scores travel under: SGLang's customized_info / meta_info, and the field of each
# OpenAI choice. One name for the runtime, the API patches and the guard.
SCORES_KEY = "token_probe_probs"
