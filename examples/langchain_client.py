"""LangChain's ChatOpenAI against `fucina serve`.

    pip install langchain-openai
    fucina serve --port 8080 &
    python examples/langchain_client.py [URL]     # default http://127.0.0.1:8080
"""
import sys

try:
    from langchain_openai import ChatOpenAI
except ImportError:
    print("skip: langchain-openai is not installed (pip install langchain-openai)")
    sys.exit(0)

url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080"
llm = ChatOpenAI(base_url=url + "/v1", api_key="none", model="any", max_tokens=16, seed=1)
print(llm.invoke("Name a colour.").content)
