# vllm-ddtree: the official vLLM OpenAI server image plus DDTree.
#   docker build -t vllm-ddtree .
#   docker run --gpus all -p 8000:8000 vllm-ddtree <target> \
#     --speculative-config '{"method": "ddtree", "model": "<DFlash drafter>", "tree_budget": 64}'
# VLLM_VERSION must equal patches/upstream-version (tests/tools/test_dockerfile.py checks it).
ARG VLLM_VERSION=0.34.0
FROM vllm/vllm-openai:v${VLLM_VERSION}

WORKDIR /opt/vllm-ddtree
COPY . .
# The same install script CI runs, in its image mode: the base image's torch and vLLM stay
# as they are; the CUDA ops are built for Hopper and Blackwell; the patch series is applied
# (refused on a base image of another vLLM release).
RUN bash scripts/setup_env.sh --image \
    && python3 -m vllm_ddtree.selfcheck

ENTRYPOINT ["vllm", "serve"]
