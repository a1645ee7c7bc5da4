// Test stand-in for torch_npu's generated operator table, which NPUStream.h includes but does not
// use: it would pull in all of ATen and make the ABI check's compile ten times slower.
#pragma once
