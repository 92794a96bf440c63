// host_test: the plugin adapters driven through their TensorRT interfaces on the CPU.
//
// Host-only stand-ins for what the adapters call outside themselves, so the test can drive them on
// a machine with TensorRT headers but without libnvinfer or a GPU:
//   * libnvinfer's getPluginRegistry() / getLogger()    -> FakeRegistry / CaptureLogger
//   * the kernel launchers of plugins/csrc/dsa_kernels.h  -> recorders of the params struct
//   * TensorRT's IExprBuilder                             -> FakeExprBuilder over concrete extents
// The launcher recorders test the adapter (which params it fills), never a kernel.
#pragma once

#include <NvInferRuntime.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dsa_kernels.h"

namespace host_test
{
namespace nv = nvinfer1;

class CaptureLogger : public nv::ILogger
{
public:
    void log(Severity severity, char const* msg) noexcept override
    {
        if (severity <= Severity::kWARNING)
            messages.emplace_back(msg);
    }
    bool saw(std::string const& needle) const
    {
        for (std::string const& m : messages)
            if (m.find(needle) != std::string::npos)
                return true;
        return false;
    }
    std::vector<std::string> messages;
};

class FakeRegistry : public nv::IPluginRegistry
{
public:
    ~FakeRegistry() noexcept override = default;
    void setErrorRecorder(nv::IErrorRecorder* const) noexcept override {}
    nv::IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
    bool isParentSearchEnabled() const override { return false; }
    void setParentSearchEnabled(bool const) override {}
    PluginLibraryHandle loadLibrary(char const*) noexcept override { return nullptr; }
    void deregisterLibrary(PluginLibraryHandle) noexcept override {}
    bool registerCreator(nv::IPluginCreatorInterface& creator, char const* const pluginNamespace) noexcept override
    {
        auto* c = static_cast<nv::IPluginCreatorV3One*>(&creator);
        std::string const key = std::string(pluginNamespace) + "::" + c->getPluginName();
        if (std::string(pluginNamespace) != c->getPluginNamespace() || creators.count(key) != 0)
            return false;
        creators[key] = &creator;
        return true;
    }
    nv::IPluginCreatorInterface* const* getAllCreators(int32_t* const n) const noexcept override
    {
        *n = 0;
        return nullptr;
    }
    nv::IPluginCreatorInterface* getCreator(
        char const* const name, char const* const /*version*/, char const* const ns = "") noexcept override
    {
        auto it = creators.find(std::string(ns) + "::" + name);
        return it == creators.end() ? nullptr : it->second;
    }
    bool deregisterCreator(nv::IPluginCreatorInterface const& creator) noexcept override
    {
        for (auto it = creators.begin(); it != creators.end(); ++it)
            if (it->second == &creator)
            {
                creators.erase(it);
                return true;
            }
        return false;
    }
    nv::IPluginResource* acquirePluginResource(char const*, nv::IPluginResource*) noexcept override { return nullptr; }
    int32_t releasePluginResource(char const*) noexcept override { return 0; }
    nv::IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const n) noexcept override
    {
        *n = 0;
        return nullptr;
    }

    std::map<std::string, nv::IPluginCreatorInterface*> creators; // "ns::name"
};

// Dimension expressions that are always constants: the shapes TensorRT would compute for one
// concrete set of input extents.
class FakeDimImpl : public nv::apiv::VDimensionExpr
{
public:
    explicit FakeDimImpl(int64_t v)
        : value(v)
    {
    }
    bool isConstant() const override { return true; }
    int64_t getConstantValue() const override { return value; }
    bool isSizeTensor() const override { return false; }
    int64_t value;
};

class FakeDim : public nv::IDimensionExpr
{
public:
    explicit FakeDim(int64_t v)
        : mValue(v)
    {
        mImpl = &mValue;
    }

private:
    FakeDimImpl mValue;
};

class FakeBuilderImpl : public nv::apiv::VExprBuilder
{
public:
    nv::IDimensionExpr const* constant(int64_t v) override
    {
        dims.push_back(std::make_unique<FakeDim>(v));
        return dims.back().get();
    }
    nv::IDimensionExpr const* operation(
        nv::DimensionOperation op, nv::IDimensionExpr const& a, nv::IDimensionExpr const& b) override
    {
        int64_t const x = a.getConstantValue();
        int64_t const y = b.getConstantValue();
        switch (op)
        {
        case nv::DimensionOperation::kSUM: return constant(x + y);
        case nv::DimensionOperation::kPROD: return constant(x * y);
        case nv::DimensionOperation::kMAX: return constant(x > y ? x : y);
        case nv::DimensionOperation::kMIN: return constant(x < y ? x : y);
        case nv::DimensionOperation::kSUB: return constant(x - y);
        case nv::DimensionOperation::kFLOOR_DIV: return constant(x / y);
        case nv::DimensionOperation::kCEIL_DIV: return constant((x + y - 1) / y);
        default: return nullptr;
        }
    }
    nv::IDimensionExpr const* declareSizeTensor(int32_t, nv::IDimensionExpr const&, nv::IDimensionExpr const&) override
    {
        return nullptr;
    }
    std::deque<std::unique_ptr<FakeDim>> dims;
};

class FakeExprBuilder : public nv::IExprBuilder
{
public:
    FakeExprBuilder() { mImpl = &impl; }
    ~FakeExprBuilder() noexcept override = default;
    nv::DimsExprs exprs(nv::Dims const& d)
    {
        nv::DimsExprs e{};
        e.nbDims = d.nbDims;
        for (int32_t i = 0; i < d.nbDims; ++i)
            e.d[i] = impl.constant(d.d[i]);
        return e;
    }
    FakeBuilderImpl impl;
};

// What the launcher stubs saw last; `nextStatus` makes the next launch fail with that status.
struct LaunchLog
{
    int calls = 0;
    int nextStatus = DSA_OK;
    DsaMlaCacheWriteParams mla{};
    DsaIndexerKCacheWriteParams indexerK{};
    DsaIndexerLogitsParams logits{};
    DsaTopkTranslateParams topk{};
    DsaSparseMlaParams sparse{};
    DsaFp8BlockLinearParams linear{};
    DsaMoeExpertsParams moe{};
    int64_t wsLinear[3] = {};   // dsa_fp8_block_linear_workspace_size(T, N, K)
    int64_t wsMoe[6] = {};      // dsa_moe_experts_workspace_size(T, top_k, E, D, I, format)
    int64_t wsRows = 0, wsMaxLen = 0, wsK = 0;
    int64_t wsTokens = 0, wsHeads = 0, wsTopk = 0, wsFormat = -1; // dsa_sparse_mla_workspace_size
};
LaunchLog& launches();
CaptureLogger& logger();
FakeRegistry& registry();

// ---------------------------------------------------------------- checking (host_test.cpp)
extern int gFailures;
extern int gChecks;
extern std::string gCase; // the case a failure message names

#define EXPECT(cond)                                                                                                   \
    do                                                                                                                 \
    {                                                                                                                  \
        ++gChecks;                                                                                                     \
        if (!(cond))                                                                                                   \
        {                                                                                                              \
            ++gFailures;                                                                                               \
            std::fprintf(stderr, "FAIL [%s] %s:%d: %s\n", gCase.c_str(), __FILE__, __LINE__, #cond);                  \
        }                                                                                                              \
    } while (0)
#define EXPECT_LOGGED(needle)                                                                                          \
    do                                                                                                                 \
    {                                                                                                                  \
        EXPECT(logger().saw(needle));                                                                                  \
        logger().messages.clear();                                                                                     \
    } while (0)

nv::Dims dims(std::initializer_list<int64_t> d);
bool sameDims(nv::Dims const& a, nv::Dims const& b);

struct FieldArg
{
    char const* name;
    bool isInt;
    double value;
};

struct TensorSpec
{
    std::vector<nv::DataType> types; // every dtype the plugin must accept here; types[0] is the one used
    nv::Dims dims;
};

struct Case
{
    std::string label;
    nv::IPluginCreatorV3One* creator;
    std::vector<FieldArg> fields;
    std::vector<TensorSpec> inputs, outputs;
    int32_t aliasedInput; // of output 0; -1 for none
    std::function<void(void const* const* in, void* const* out)> checkLaunch;
    std::function<void(std::vector<nv::PluginTensorDesc>& in)> breakShape;
    char const* breakMessage;
};

nv::IPluginV3* create(Case const& c, bool wide, FieldArg const* skip = nullptr, double override = 0.0);
void testFields(Case const& c);  // the creator: names, parsing, every rejection path
void testPlugin(Case const& c);  // one plugin through IPluginV3: types, shapes, formats, enqueue, ...

} // namespace host_test
