"""Credentials shared by the router and the workers: API keys, TLS/mTLS material and registry-entry signing.

A leaf component: it imports nothing else of Tandem, so the router and every worker may import it.
"""
