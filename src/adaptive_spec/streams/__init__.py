"""Reading llama-server's answers: the SSE reader, the stream tap that meters a response as it passes, timings, the
output text.
"""
