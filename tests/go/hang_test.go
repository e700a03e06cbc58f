package gotests

import "time"

// hang bounds a wait of these tests for something that normally takes
// milliseconds (a control call, a counter catching up, a condition over
// real sockets). It is a hang detector, not a speed claim: a host loaded
// far beyond its cores (the test command beside a CPU hog reaches a load
// average of 40 on two cores) stays well inside it.
const hang = 60 * time.Second
