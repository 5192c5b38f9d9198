"""`sluice simulate`: a discrete-event model of a gateway and its workers, to compare scaling policies
through a day of traffic (docs/scaling.md).

    profile.py   a worker's per-step costs (measured on this machine, or the H100-class model)
    traffic.py   arrivals: a day with a morning peak and bursts, or plain Poisson
    fleet.py     the event loop: gateway queue by tier, shedding, hold at zero, continuous-batching workers
    policies.py  fixed size, reactive on the desired-workers signal, reactive + hour-of-day forecast
    report.py    per-tier TTFT SLO attainment, shed requests, worker-hours; PNG plots
    queueing.py  Erlang C (M/M/c), the closed form the simulator is checked against
"""
