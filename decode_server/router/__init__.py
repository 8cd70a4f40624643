"""The PD router: the OpenAI front door of a prefill/decode deployment (`decode-server router`).

It picks a (prefill, decode) pair per request, adds the bootstrap fields, sends the same body to both workers
and returns decode's answer. It is a plain asyncio HTTP proxy: nothing here may import the engine, the model
or torch (a test checks), so that it starts in a fraction of a second on any machine.
"""
